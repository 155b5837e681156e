"""The runtime: the compiled kernels as files and as loaded code, below any torch op.

variants (the table of compiled kernels), manifest (the facts the build and the loader share),
codeobject (reads a code object's metadata), artifacts (where the code objects are, verified against
their manifest), driver (ctypes bindings to the HIP runtime or CUDA driver already in the process),
device (what a torch device is), loader (loads a device's code object once and launches its kernels).
"""
