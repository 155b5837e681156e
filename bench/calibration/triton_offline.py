"""Triton compilation for an AMD target without a GPU, shared by the calibration's compile scripts
(compile_aiter_gfx1100.py, compile_triton_tutorial_gfx1100.py): Triton's own binder specializes a
kernel's arguments, tensors given as FakeTensor stand-ins, as a launch on the target would (signature,
constexprs, attrs), then triton.compile() writes the code object and its intermediate forms; and the
external sources those scripts compile, imported from the folder given on their command line."""
import importlib
import importlib.util
import os
import sys

# Triton's default (FP fusion on, as in earlier releases), set explicitly to silence 3.9's deprecation
# warning; an empty or 0 value would change the code.
os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"
os.environ.pop("TRITON_FORCE_DISABLE_FP_FUSION", None)

import torch  # noqa: E402  (CPU torch, only for dtypes)
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile as triton_compile, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

GFX1100 = GPUTarget("hip", "gfx1100", 32)


def import_external(folder: str, name: str):
    """The module `name` (dotted: a package's module) of the sources in `folder`, which are kept outside
    the repository: its top-level module or package is loaded from the folder by its path."""
    top = name.split(".")[0]
    location = os.path.join(folder, top, "__init__.py")
    if not os.path.isfile(location):
        location = os.path.join(folder, f"{top}.py")
    spec = importlib.util.spec_from_file_location(top, location)
    module = importlib.util.module_from_spec(spec)
    sys.modules[top] = module
    spec.loader.exec_module(module)
    return importlib.import_module(name)


class FakeTensor:
    """Stand-in for a contiguous torch GPU tensor for Triton's specialization only."""

    def __init__(self, shape, dtype):
        self.shape = tuple(shape)
        self.dtype = dtype
        strides, size = [], 1
        for extent in reversed(self.shape):
            strides.append(size)
            size *= extent
        self._stride = tuple(reversed(strides))
        self._nbytes = size * torch.empty((), dtype=dtype).element_size()

    def stride(self, i=None):
        return self._stride if i is None else self._stride[i]

    def data_ptr(self):
        return 0x7F0000000000  # torch allocations are >= 256-byte aligned

    def ptr_range(self):
        return self._nbytes  # HIPBackend.is_within_2gb: the buffer-op `tt.pointer_range` 32 specialization


def compile_kernel(fn, args, kwargs, target, stem, forms=("ttir", "ttgir", "llir", "amdgcn")):
    """Binds `args` and `kwargs` as JITFunction.run would on `target`, compiles, writes stem.hsaco and
    stem.<form> for each intermediate form Triton produced; returns the compiled kernel."""
    kwargs = dict(kwargs)
    # JITFunction.run adds these
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, _ = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, None)
    print("signature (non-constexpr):", {name: ty for name, ty in signature.items() if ty != "constexpr"})
    print("constexprs:", {fn.arg_names[path[0]]: value for path, value in constexprs.items()})
    print("attrs:", {fn.arg_names[path[0]]: value for path, value in attrs.items() if value})
    print("options:", {k: getattr(options, k) for k in ("arch", "num_warps", "num_stages", "waves_per_eu", "num_ctas")})
    compiled = triton_compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    with open(stem + ".hsaco", "wb") as f:
        f.write(compiled.asm["hsaco"])
    for form in forms:
        if form in compiled.asm:
            with open(f"{stem}.{form}", "w") as f:
                f.write(compiled.asm[form])
    md = compiled.metadata
    print("wrote", stem + ".hsaco", len(compiled.asm["hsaco"]), "bytes; kernel", md.name, "LDS bytes (allocated at "
          "launch):", md.shared, "threads/WG:", md.num_warps * target.warp_size)
    return compiled
