"""setuptools reads setup.cfg; this file only ships ``ds_patrickstar_autoload.pth`` into
site-packages, for wheel and editable installs alike (see ds_patrickstar_autoload.py)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "ds_patrickstar_autoload.pth"


class BuildPyWithPth(build_py):
    """A wheel: the .pth at the wheel's root, which pip installs into site-packages."""

    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class EditableWheelWithPth(editable_wheel):
    """``pip install -e .``: setuptools' editable wheel holds only its own path hook; add the .pth."""

    def _select_strategy(self, *args, **kwargs):
        strategy = super()._select_strategy(*args, **kwargs)
        with open(PTH, "rb") as f:
            content = f.read()

        class WithPth:
            def __call__(self, wheel, files, mapping):
                strategy(wheel, files, mapping)
                wheel.writestr(PTH, content)

            def __enter__(self):
                strategy.__enter__()
                return self

            def __exit__(self, *exc):
                return strategy.__exit__(*exc)

        return WithPth()


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
