"""C++/CUDA sources of the fused chunk Adam kernels, shipped as package data.

Installed as ``ds_patrickstar.csrc`` (see setup.cfg); ``ds_patrickstar.kernels``
JIT-compiles them from their installed location.
"""
