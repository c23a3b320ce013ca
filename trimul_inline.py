"""trimul_inline — AlphaFold's triangle multiplicative update with JIT-compiled CUDA kernels.

    from trimul_inline import Model, ModelNew
    model = ModelNew(pair_dim=128, hidden_dim=128).cuda()        # same parameters as Model
    out = model(pair_repr, pair_mask)                            # (B, N, N, C)

`Model` is the reference (plain PyTorch). `ModelNew` has the same parameters and state_dict keys
and computes the triangle contraction with a CUDA kernel from kernels/, compiled on first use by
torch.utils.cpp_extension.load_inline and cached on disk (TRIMUL_VERBOSE=1 shows the build).

    python trimul_inline.py build                          # compile now, print where it went
    python trimul_inline.py bundle -o trimul_notebook.py   # one self-contained file for notebooks
"""
import argparse
import contextlib
import glob
import hashlib
import importlib.machinery
import importlib.util
import math
import os
import re
import shutil
import sys
import warnings
from typing import NamedTuple, Optional

import torch
import torch.nn as nn

__all__ = [
    "Model", "ModelNew", "VARIANTS", "Variant", "contract", "load_extension", "reload_extension",
    "kernel_sources", "build_key", "find_toolkit", "bundle_source", "reference_forward",
]

DIRECTIONS = ("outgoing", "incoming")
GATE_INPUTS = ("raw", "normalized")
PRECISIONS = ("highest", "high", "medium")  # torch.get_float32_matmul_precision() names
_PRECISION_CODE = {"highest": 0, "high": 1, "medium": 2}


# ------------------------------------------------------------------------------------------------
# The reference model (the seed's, with the two options real models need)
# ------------------------------------------------------------------------------------------------
class _TriMulLayers(nn.Module):
    """The parameters shared by Model and ModelNew, so their state_dicts are interchangeable."""

    def __init__(self, pair_dim: int, hidden_dim: int, direction: str = "outgoing",
                 gate_input: str = "raw"):
        super().__init__()
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if gate_input not in GATE_INPUTS:
            raise ValueError(f"gate_input must be one of {GATE_INPUTS}, got {gate_input!r}")
        self.pair_dim, self.hidden_dim = pair_dim, hidden_dim
        self.direction, self.gate_input = direction, gate_input
        self.layer_norm_in = nn.LayerNorm(pair_dim)
        self.proj_a = nn.Linear(pair_dim, hidden_dim)
        self.gate_a = nn.Linear(pair_dim, hidden_dim)
        self.proj_b = nn.Linear(pair_dim, hidden_dim)
        self.gate_b = nn.Linear(pair_dim, hidden_dim)
        self.layer_norm_out = nn.LayerNorm(hidden_dim)
        self.out_proj = nn.Linear(hidden_dim, pair_dim)
        self.out_gate = nn.Linear(pair_dim, pair_dim)

    def extra_repr(self) -> str:
        return f"direction={self.direction!r}, gate_input={self.gate_input!r}"


def reference_forward(layers: _TriMulLayers, pair_repr: torch.Tensor, pair_mask: torch.Tensor):
    """The seed's computation, verbatim but for the direction and gate-input options."""
    x = layers.layer_norm_in(pair_repr)
    m = pair_mask.unsqueeze(-1)
    a = layers.proj_a(x) * torch.sigmoid(layers.gate_a(x)) * m
    b = layers.proj_b(x) * torch.sigmoid(layers.gate_b(x)) * m
    if layers.direction == "outgoing":
        z = torch.einsum("bikh,bjkh->bijh", a, b)
    else:
        z = torch.einsum("bkih,bkjh->bijh", a, b)
    o = layers.out_proj(layers.layer_norm_out(z))
    gate_source = pair_repr if layers.gate_input == "raw" else x
    return torch.sigmoid(layers.out_gate(gate_source)) * o


class Model(_TriMulLayers):
    """Reference triangle multiplicative update: pair_repr (B,N,N,C), pair_mask (B,N,N) -> (B,N,N,C)."""

    def forward(self, pair_repr: torch.Tensor, pair_mask: torch.Tensor) -> torch.Tensor:
        return reference_forward(self, pair_repr, pair_mask)


# ------------------------------------------------------------------------------------------------
# Kernel variants: one registry. A variant named here with backend "cuda" must be registered in
# kernels/ with TRIMUL_REGISTER_CONTRACTION(<name>, launcher).
# ------------------------------------------------------------------------------------------------
class Variant(NamedTuple):
    name: str
    summary: str
    dtypes: tuple = ("float32", "bfloat16", "float16")  # operand dtypes it takes
    precisions: tuple = PRECISIONS  # fp32 precisions it may serve; fp32-accurate kernels serve all
    min_capability: tuple = (7, 0)
    max_capability: tuple = (99, 99)
    backend: str = "cuda"  # "cuda": a kernel of ours in kernels/; "torch": a PyTorch baseline


VARIANTS = {v.name: v for v in (
    Variant("naive", "one thread per output element, fp32 FMA (the seed's approach; baseline)"),
    Variant("tiled", "64x64 shared-memory tiles, 4x4 outputs per thread, fp32 FMA"),
    Variant("mma", "tensor cores (mma.sync), 128x128 tiles, cp.async pipeline; 3xTF32 for highest",
            min_capability=(8, 0)),
    Variant("wgmma", "Hopper wgmma (sm_90a build): 128x128 tiles, two warpgroups reading 128-byte-"
            "swizzled smem, 4-buffer cp.async pipeline; bf16/fp16 (the fused forward also feeds it "
            "its TF32-rounded operands at \"high\")",
            dtypes=("bfloat16", "float16"), min_capability=(9, 0), max_capability=(9, 0)),
    Variant("wgmma_tma", "Hopper wgmma + TMA (sm_90a build): 128x256 tiles, one producer thread issuing "
            "TMA loads into a 4-stage mbarrier pipeline, two consumer warpgroups of m64n256 (16-bit z stored "
            "through shared memory as 16-byte rows); bf16/fp16",
            dtypes=("bfloat16", "float16"), min_capability=(9, 0), max_capability=(9, 0)),
    Variant("wgmma_pingpong", "Hopper wgmma + TMA (sm_90a build), persistent: 128x128 tiles taken in turn "
            "by two consumer warpgroups, so one's stores overlap the other's products; 6-stage ring; "
            "bf16/fp16 (not in auto: measured slower than wgmma_tma, NOTES v22)",
            dtypes=("bfloat16", "float16"), min_capability=(9, 0), max_capability=(9, 0)),
    Variant("bmm", "torch.bmm (cuBLAS) on the same layout; a baseline, not a kernel of ours",
            backend="torch"),
)}
# kernel="auto" takes the first variant here that supports the call: fastest first.
AUTO_ORDER = ("wgmma_tma", "wgmma", "mma", "tiled", "naive")


def _variant_supports(variant: Variant, dtype: torch.dtype, precision: str, capability) -> bool:
    dtype_name = str(dtype).replace("torch.", "")
    if dtype_name not in variant.dtypes:
        return False
    if dtype == torch.float32 and precision not in variant.precisions:
        return False
    return variant.min_capability <= tuple(capability) <= variant.max_capability


_TORCH_BACKED = frozenset(name for name, v in VARIANTS.items() if v.backend == "torch")
_CAPABILITY = {}  # device index -> compute capability (a driver query costs more than a small forward)


def _capability(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def select_variant(name: str, dtype: torch.dtype, precision: str, device: torch.device) -> Variant:
    """The variant that runs a contraction of `dtype` operands at `precision` on `device`."""
    capability = _capability(device)
    if name == "auto":
        for candidate in AUTO_ORDER:
            if _variant_supports(VARIANTS[candidate], dtype, precision, capability):
                return VARIANTS[candidate]
        raise TypeError(f"trimul_inline: no kernel supports {dtype} operands at precision "
                        f"{precision!r} on a capability {capability} GPU")
    variant = VARIANTS[name]
    if not _variant_supports(variant, dtype, precision, capability):
        raise TypeError(f"trimul_inline: kernel {name!r} does not support {dtype} operands at "
                        f"precision {precision!r} on a capability {capability} GPU (it takes "
                        f"{variant.dtypes}, precisions {variant.precisions}, capability "
                        f"{variant.min_capability} to {variant.max_capability})")
    return variant


# ------------------------------------------------------------------------------------------------
# Kernel sources, toolkit discovery and the build cache
# ------------------------------------------------------------------------------------------------
_EMBEDDED_KERNELS = None  # `python trimul_inline.py bundle` replaces this with {file name: text}
_KERNEL_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")
_NVCC_FLAGS = ("-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr", "--split-compile=0")
_CXX_FLAGS = ("-O3",)  # torch picks the C++ standard its headers need


def _default_kernel_dir() -> str:
    here = globals().get("__file__")
    if not here:
        raise RuntimeError("trimul_inline: no kernels: this copy has no kernels/ folder and no "
                           "embedded kernels (make a notebook file with `python trimul_inline.py "
                           "bundle`)")
    return os.path.join(os.path.dirname(os.path.abspath(here)), "kernels")


def kernel_sources(kernel_dir: Optional[str] = None) -> dict:
    """{file name: text} of every kernel source: the embedded copy in a bundle, else kernels/."""
    if kernel_dir is None and _EMBEDDED_KERNELS is not None:
        return dict(_EMBEDDED_KERNELS)
    kernel_dir = kernel_dir or _default_kernel_dir()
    if not os.path.isdir(kernel_dir):
        raise RuntimeError(f"trimul_inline: kernel folder {kernel_dir} does not exist")
    sources = {}
    for name in sorted(os.listdir(kernel_dir)):
        if name.endswith(_KERNEL_SUFFIXES):
            with open(os.path.join(kernel_dir, name), encoding="utf-8") as f:
                sources[name] = f.read()
    if "bindings.cpp" not in sources:
        raise RuntimeError(f"trimul_inline: {kernel_dir} has no bindings.cpp")
    return sources


_LOCAL_INCLUDE = re.compile(r'\s*#\s*include\s+"([^"]+)"')


def _inline_includes(name: str, sources: dict, seen: set) -> str:
    """Text of `name` with its local #includes inlined once each, keeping file/line positions."""
    lines = [f'#line 1 "kernels/{name}"']
    for number, line in enumerate(sources[name].splitlines(), start=1):
        match = _LOCAL_INCLUDE.match(line)
        if match:
            header = match.group(1)
            if header not in sources:
                raise RuntimeError(f"trimul_inline: kernels/{name}:{number} includes {header!r}, "
                                   "which is not in kernels/")
            if header not in seen:
                seen.add(header)
                lines.append(_inline_includes(header, sources, seen))
                lines.append(f'#line {number + 1} "kernels/{name}"')
                continue
            line = f"// (already included) {line.strip()}"
        elif line.strip() == "#pragma once":
            line = ""
        lines.append(line)
    return "\n".join(lines)


def assemble_sources(sources: dict):
    """(host source, CUDA source) for load_inline: bindings.cpp, and every .cu as one unit."""
    host = _inline_includes("bindings.cpp", sources, set())
    seen = set()
    cuda = [_inline_includes(name, sources, seen) for name in sorted(sources) if name.endswith(".cu")]
    return host, "\n".join(cuda)


class Toolkit(NamedTuple):
    home: str
    version: str  # CUDART_VERSION, e.g. "13000"
    extra_includes: tuple  # pip's nvidia/cuXX/include: headers some toolkits lack
    extra_lib_dirs: tuple


def _cudart_version(home: str) -> Optional[str]:
    header = os.path.join(home, "include", "cuda_runtime_api.h")
    try:
        with open(header, encoding="utf-8", errors="replace") as f:
            match = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", f.read())
    except OSError:
        return None
    return match.group(1) if match else None


def _has_cudart_library(home: str) -> bool:
    for lib_dir in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"),
                    os.path.join("targets", "sbsa-linux", "lib")):
        if glob.glob(os.path.join(home, lib_dir, "libcudart.so*")):
            return True
    return False


def _pip_cuda_dirs():
    """Include and library folders of pip's nvidia wheels for torch's CUDA major version."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations or not torch.version.cuda:
        return (), ()
    major = torch.version.cuda.split(".")[0]
    includes, libs = [], []
    for root in spec.submodule_search_locations:
        sub = os.path.join(root, f"cu{major}")
        if os.path.isdir(os.path.join(sub, "include")):
            includes.append(os.path.join(sub, "include"))
        if os.path.isdir(os.path.join(sub, "lib")):
            libs.append(os.path.join(sub, "lib"))
    return tuple(includes), tuple(libs)


def find_toolkit(environ=None) -> Toolkit:
    """The CUDA toolkit to build with, or a RuntimeError naming what is missing.

    CUDA_HOME / CUDA_PATH win when set. Otherwise nvcc on PATH and the usual folders are tried;
    a toolkit counts only with bin/nvcc, include/cuda_runtime_api.h and libcudart (an nvcc wrapper
    in /usr/local/bin does not make /usr/local a toolkit).
    """
    environ = os.environ if environ is None else environ
    explicit = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    if explicit:
        candidates = [explicit]
    else:
        candidates = []
        nvcc = shutil.which("nvcc", path=environ.get("PATH", ""))
        if nvcc:
            real = os.path.realpath(nvcc)
            candidates.append(os.path.dirname(os.path.dirname(real)))
            # A wrapper script (`exec /usr/local/cuda-13.0/bin/nvcc "$@"`) names the real one.
            try:
                with open(real, "rb") as f:
                    head = f.read(4096).decode("utf-8", "replace")
                candidates += [os.path.dirname(os.path.dirname(p))
                               for p in re.findall(r"(/\S+/bin/nvcc)\b", head)]
            except OSError:
                pass
        candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    problems = []
    for home in dict.fromkeys(candidates):
        if not os.path.isfile(os.path.join(home, "bin", "nvcc")):
            problems.append(f"{home}: no bin/nvcc")
            continue
        version = _cudart_version(home)
        if version is None:
            problems.append(f"{home}: no include/cuda_runtime_api.h")
            continue
        includes, libs = _pip_cuda_dirs()
        if not _has_cudart_library(home) and not any(glob.glob(os.path.join(d, "libcudart.so*"))
                                                     for d in libs):
            problems.append(f"{home}: no libcudart.so")
            continue
        return Toolkit(home, version, includes, libs)
    where = "; ".join(problems) if problems else "nothing to look at"
    raise RuntimeError(
        "trimul_inline: cannot build the CUDA extension: no usable CUDA toolkit (nvcc, CUDA headers "
        f"and libcudart) was found ({where}). Install the CUDA toolkit or set CUDA_HOME to it.")


def target_arch() -> str:
    """nvcc arch suffix: the current GPU's (sm_90a on Hopper, for wgmma); 90a with no GPU."""
    env = os.environ.get("TRIMUL_CUDA_ARCH")
    if env:
        return env
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
    return "90a"


def build_key(sources: dict, arch: str, toolkit_version: str) -> str:
    """Hash of everything the built .so depends on; it names the extension and its build folder."""
    digest = hashlib.sha256()
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + sources[name].encode() + b"\0")
    for part in (_NVCC_FLAGS, _CXX_FLAGS, torch.__version__, torch.version.cuda, toolkit_version,
                 arch, sys.implementation.cache_tag):
        digest.update(repr(part).encode() + b"\0")
    return digest.hexdigest()[:16]


def extensions_root() -> str:
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions", "trimul_inline")


def _verbose() -> bool:
    return os.environ.get("TRIMUL_VERBOSE", "0") not in ("", "0")


def _say(message: str) -> None:
    print(f"trimul_inline: {message}", file=sys.stderr, flush=True)


class BuildPlan(NamedTuple):
    name: str
    build_dir: str
    so_path: str
    arch: str
    toolkit: Toolkit
    sources: dict


def plan_build(kernel_dir: Optional[str] = None) -> BuildPlan:
    sources = kernel_sources(kernel_dir)
    toolkit = find_toolkit()
    arch = target_arch()
    name = f"trimul_inline_{build_key(sources, arch, toolkit.version)}"
    build_dir = os.path.join(extensions_root(), name)
    return BuildPlan(name, build_dir, os.path.join(build_dir, name + ".so"), arch, toolkit, sources)


@contextlib.contextmanager
def _torch_cuda_home(home: str):
    # torch guesses CUDA_HOME once, at import, from `which nvcc`; a wrapper script fools it.
    from torch.utils import cpp_extension
    saved = cpp_extension.CUDA_HOME
    cpp_extension.CUDA_HOME = home
    try:
        yield
    finally:
        cpp_extension.CUDA_HOME = saved


def _compile_extension(plan: BuildPlan, verbose: bool):
    import inspect
    from torch.utils import cpp_extension
    host, cuda = assemble_sources(plan.sources)
    os.makedirs(plan.build_dir, exist_ok=True)
    nvcc_flags = list(_NVCC_FLAGS) + [f"-gencode=arch=compute_{plan.arch},code=sm_{plan.arch}"]
    cxx_flags = list(_CXX_FLAGS) + [f"-idirafter{d}" for d in plan.toolkit.extra_includes]
    ldflags = [f"-L{d}" for d in plan.toolkit.extra_lib_dirs]
    kwargs = {}
    if "no_implicit_headers" in inspect.signature(cpp_extension.load_inline).parameters:
        kwargs["no_implicit_headers"] = True  # keeps torch headers out of the nvcc unit
    with _torch_cuda_home(plan.toolkit.home):
        return cpp_extension.load_inline(
            name=plan.name, cpp_sources=[host], cuda_sources=[cuda], extra_cflags=cxx_flags,
            extra_cuda_cflags=nvcc_flags, extra_ldflags=ldflags, build_directory=plan.build_dir,
            verbose=verbose, with_cuda=True, **kwargs)


def _import_built(plan: BuildPlan):
    loader = importlib.machinery.ExtensionFileLoader(plan.name, plan.so_path)
    spec = importlib.util.spec_from_file_location(plan.name, plan.so_path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


_LOADED = {}  # extension name -> module, for this process
_DEFAULT_EXTENSION = None


def load_extension(kernel_dir: Optional[str] = None, verbose: Optional[bool] = None):
    """The compiled extension for these kernel sources: memoized, else the cached .so, else built."""
    verbose = _verbose() if verbose is None else verbose
    plan = plan_build(kernel_dir)
    if plan.name in _LOADED:
        return _LOADED[plan.name]
    done_marker = plan.so_path + ".ok"  # written only after a build finished and imported
    if os.path.exists(plan.so_path) and os.path.exists(done_marker):
        if verbose:
            _say(f"reusing cached build {plan.so_path}")
        module = _import_built(plan)
    else:
        if verbose:
            _say(f"building {plan.name} for sm_{plan.arch} with {plan.toolkit.home} (CUDA "
                 f"{plan.toolkit.version}) in {plan.build_dir}")
        module = _compile_extension(plan, verbose)
        with open(done_marker, "w") as f:
            f.write(plan.name + "\n")
    missing = [v.name for v in VARIANTS.values()
               if v.backend == "cuda" and v.name not in module.contraction_variants()]
    if missing:
        raise RuntimeError(f"trimul_inline: the registry names kernels that kernels/ does not "
                           f"register with TRIMUL_REGISTER_CONTRACTION: {missing}")
    _LOADED[plan.name] = module
    return module


def reload_extension(verbose: Optional[bool] = None):
    """Re-read kernels/, rebuild if anything changed, and use the result from now on."""
    global _DEFAULT_EXTENSION
    _DEFAULT_EXTENSION = load_extension(verbose=verbose)
    return _DEFAULT_EXTENSION


def _extension():
    return _DEFAULT_EXTENSION if _DEFAULT_EXTENSION is not None else reload_extension()


# ------------------------------------------------------------------------------------------------
# The op: z[batch, i, j] = sum_k a[batch, i, k] * b[batch, j, k]
# ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _float32_matmul_precision(precision: str):
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def contract_into(z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, variant: str,
                  precision: str) -> torch.Tensor:
    """Runs the named variant, writing z (no autograd; the building block of the op)."""
    select_variant(variant, a.dtype, precision, a.device)  # raises if it does not take this call
    if VARIANTS[variant].backend == "torch":
        with _float32_matmul_precision(precision):
            torch.bmm(a, b.transpose(1, 2), out=z) if z.dtype == a.dtype else \
                z.copy_(torch.bmm(a, b.transpose(1, 2)))
        return z
    _extension().contract(variant, a, b, z, _PRECISION_CODE[precision])
    return z


@torch.library.custom_op("trimul_inline::contract", mutates_args=())
def contract(a: torch.Tensor, b: torch.Tensor, variant: str, precision: str) -> torch.Tensor:
    """z = a @ b^T for a [batch, m, k], b [batch, n, k] (contiguous CUDA); z has a's dtype."""
    z = a.new_empty((a.shape[0], a.shape[1], b.shape[1]))
    return contract_into(z, a, b, variant, precision)


@contract.register_fake
def _contract_fake(a, b, variant, precision):
    return a.new_empty((a.shape[0], a.shape[1], b.shape[1]))


def _contract_setup_context(ctx, inputs, output):
    a, b, _, precision = inputs
    ctx.save_for_backward(a, b)
    ctx.precision = precision


def _contract_backward(ctx, grad_z):
    a, b = ctx.saved_tensors
    grad_z = grad_z.to(a.dtype)
    with _float32_matmul_precision(ctx.precision):
        grad_a = torch.bmm(grad_z, b) if ctx.needs_input_grad[0] else None
        grad_b = torch.bmm(grad_z.transpose(1, 2), a) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None, None


contract.register_autograd(_contract_backward, setup_context=_contract_setup_context)


# ------------------------------------------------------------------------------------------------
# The fused forward: input pass -> contraction -> output pass, one extension call
# ------------------------------------------------------------------------------------------------
# Compute modes of the fused kernels: the operand type in shared memory and the mma flavour.
_MODE_CODE = {"bf16": 0, "f16": 1, "tf32": 2, "tf32x3": 3}
_MODE_OPERAND = {"bf16": torch.bfloat16, "f16": torch.float16, "tf32": torch.float32,
                 "tf32x3": torch.float32}
_PRECISION_MODE = {"highest": "tf32x3", "high": "tf32", "medium": "bf16"}
_MODE_PRECISION = {mode: precision for precision, mode in _PRECISION_MODE.items()}


def compute_mode(pair_dtype: torch.dtype, precision: str) -> str:
    """bf16/fp16 inputs compute in their dtype; fp32 inputs follow autocast, else `precision`."""
    if pair_dtype == torch.bfloat16:
        return "bf16"
    if pair_dtype == torch.float16:
        return "f16"
    if torch.is_autocast_enabled("cuda"):
        return "bf16" if torch.get_autocast_dtype("cuda") == torch.bfloat16 else "f16"
    return _PRECISION_MODE[precision]


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


_PARAM_PATHS = (("layer_norm_in", "weight"), ("layer_norm_in", "bias"), ("proj_a", "weight"),
                ("proj_a", "bias"), ("gate_a", "weight"), ("gate_a", "bias"), ("proj_b", "weight"),
                ("proj_b", "bias"), ("gate_b", "weight"), ("gate_b", "bias"),
                ("layer_norm_out", "weight"), ("layer_norm_out", "bias"), ("out_proj", "weight"),
                ("out_proj", "bias"), ("out_gate", "weight"), ("out_gate", "bias"))
_SUBMODULES = tuple(dict.fromkeys(module for module, _ in _PARAM_PATHS))


def _param_list(layers: "_TriMulLayers"):
    """The 16 parameters in prepare_weights' order (through nn.Module attributes: traceable)."""
    return [getattr(getattr(layers, module), name) for module, name in _PARAM_PATHS]


def _param_list_eager(layers: "_TriMulLayers"):
    """_param_list by direct dict lookups (nn.Module.__getattr__ costs ~1 us a call, a good part of
    a small forward); falls back for modules whose parameters live elsewhere (parametrizations)."""
    try:
        modules = layers._modules
        return [modules[module]._parameters[name] for module, name in _PARAM_PATHS]
    except KeyError:
        return _param_list(layers)


def prepare_weights(params, mode: str):
    """The layout the fused kernels stream: fp32 norms and biases; weights in the operand type,
    k padded to 32 and rows to 128 with zeros; proj/gate rows in groups of 16 (rows 16g + e = proj
    and 16g + 8 + e = gate of h = 8g + e), so the input pass's mma fragment rows g and g + 8 hold
    both halves of one gated output. LayerNorm_out's weight and bias are folded into out_proj's
    weight and bias (its own entries stay in the list for the sizes only). The 16-bit modes add the
    register-row input kernel's weights (_register_row_weights), the fp32 modes (tf32, tf32x3) the
    wgmma passes' scaled fp16 operands (_f16x3_weights)."""
    (ln_in_w, ln_in_b, pa_w, pa_b, ga_w, ga_b, pb_w, pb_b, gb_w, gb_b, ln_out_w, ln_out_b,
     out_w, out_b, gate_w, gate_b) = [p.detach() for p in params]
    hidden, pair_dim = pa_w.shape
    c_pad, h_pad, rows_ab = _round_up(pair_dim, 32), _round_up(hidden, 32), _round_up(2 * hidden, 128)
    f32 = dict(device=pa_w.device, dtype=torch.float32)

    def grouped(proj_w, proj_b, gate_w_, gate_b_):
        w = torch.zeros(rows_ab, c_pad, **f32)
        b = torch.zeros(rows_ab, **f32)
        h = torch.arange(hidden, device=pa_w.device)
        proj_rows = 16 * (h // 8) + h % 8
        w[proj_rows, :pair_dim] = proj_w.float()
        w[proj_rows + 8, :pair_dim] = gate_w_.float()
        b[proj_rows] = proj_b.float()
        b[proj_rows + 8] = gate_b_.float()
        return w, b

    wa, ba = grouped(pa_w, pa_b, ga_w, ga_b)
    wb, bb = grouped(pb_w, pb_b, gb_w, gb_b)
    rows_c = _round_up(pair_dim, 128)
    w_gate = torch.zeros(rows_c, c_pad, **f32)
    w_gate[:pair_dim, :pair_dim] = gate_w
    # LayerNorm_out's affine folded into out_proj (the kernels only normalize z): W diag(w) and
    # b_out + W b, the latter in fp64 so no TF32 matmul rounds it.
    w_out = torch.zeros(rows_c, h_pad, **f32)
    w_out[:pair_dim, :hidden] = out_w.float() * ln_out_w.float()
    out_b = (out_b.double() + out_w.double() @ ln_out_b.double()).float()
    operand = _MODE_OPERAND[mode]
    as_f32 = lambda t: t.to(**f32).contiguous()
    # TF32 operands go in as TF32 values, so the kernels feed the mma their bits unconverted.
    as_operand = (lambda t: _round_to_tf32(t)) if mode == "tf32" else (lambda t: t.to(operand))
    w_in = torch.cat([wa, wb])
    prepared = [as_f32(ln_in_w), as_f32(ln_in_b), as_f32(ln_out_w), as_f32(ln_out_b),
                as_operand(w_in), torch.cat([ba, bb]), as_operand(w_gate),
                as_f32(gate_b), as_operand(w_out), as_f32(out_b)]
    if mode in ("bf16", "f16"):  # (the input kernel with the rows in registers: ForwardArgs::w_in_rows)
        prepared += _register_row_weights(w_in, torch.cat([ba, bb]), ln_in_w, ln_in_b, operand)
    if mode in ("tf32", "tf32x3"):  # (the wgmma passes' scaled fp16 arithmetic: ForwardArgs::w_in_f16x3)
        prepared += _f16x3_weights(w_in, w_gate, w_out, ln_in_w.float(), ln_in_b.float(), pair_dim, hidden,
                                   torch.cat([pa_w, pb_w]).float(), torch.cat([pa_b, pb_b]).float())
    return prepared


def _register_row_weights(w_in, b_in, ln_w, ln_b, operand):
    """The 16-bit input kernel with the rows in registers (ForwardArgs::w_in_rows): the grouped w_in
    (fp32 [rows, c_pad]) with LayerNorm_in's affine folded in, W diag(w_ln), so the kernel only normalizes;
    k permuted within each 16-channel block, k = 16s + 8hh + 2t + e holding channel 16s + 4t + 2hh + e, so
    that a thread's wgmma A fragment for k-step s (k 16s + 2t + e and 16s + 8 + 2t + e) is 4 adjacent
    channels of its row: one 16-byte load; then 64 more columns, the biases b_in + W b_ln (fp64) as a
    part and a remainder in the operand type (columns c_pad, c_pad + 1), multiplied by ones in one more
    k-step."""
    rows, c_pad = w_in.shape
    pair_dim = ln_w.shape[0]
    k = torch.arange(c_pad, device=w_in.device)
    block, within = k // 16, k % 16
    channel = 16 * block + 4 * ((within % 8) // 2) + 2 * (within // 8) + within % 2
    w_ln = torch.zeros(c_pad, device=w_in.device, dtype=torch.float32)
    b_ln = torch.zeros(c_pad, device=w_in.device, dtype=torch.float64)
    w_ln[:pair_dim] = ln_w.float()
    b_ln[:pair_dim] = ln_b.double()
    bias = (b_in.double() + w_in.double() @ b_ln).float()
    # The part by bit arithmetic, not bias.to(operand).float(): inductor elides such a round trip under
    # torch.compile and the remainders would come out zero.
    part = _round_mantissa(bias, 7 if operand == torch.bfloat16 else 10)
    prepared = torch.zeros(rows, c_pad + 64, device=w_in.device, dtype=operand)
    prepared[:, :c_pad] = (w_in * w_ln)[:, channel].to(operand)
    prepared[:, c_pad] = part.to(operand)
    prepared[:, c_pad + 1] = (bias - part).to(operand)
    return [prepared]


def _power_of_two_to_4096(bound: torch.Tensor) -> torch.Tensor:
    """The exponent e (a tensor: no host sync) with bound * 2^e in (2^11, 2^12], kept in [-60, 60]."""
    return (12 - torch.ceil(torch.log2(bound.clamp_min(2.0 ** -60)))).clamp(-60, 60)


def _f16x3_split(w: torch.Tensor):
    """w (fp32 [rows, k_pad]) times 2^t as the wgmma passes' fp16x3 operand: per row [hi | lo] in
    fp16, each segment round_up(k_pad, 64) wide; and t."""
    rows, k_pad = w.shape
    segment = _round_up(k_pad, 64)
    t = _power_of_two_to_4096(w.abs().amax())
    scaled = w * torch.exp2(t)
    # The part by bit arithmetic, not scaled.half().float(): under torch.compile inductor elides such a
    # round trip (it does not emulate precision casts), which left every remainder zero. TF32's
    # significand is fp16's, and scaled <= 2^12 stays in fp16's range.
    hi32 = _round_to_tf32(scaled)
    hi = hi32.half()
    lo = (scaled - hi32).half()
    split = torch.zeros(rows, 2 * segment, device=w.device, dtype=torch.float16)
    for start, part in ((0, hi), (segment, lo)):
        split[:, start:start + k_pad] = part
    return split, t


def _f16x3_weights(w_in, w_gate, w_out, ln_w, ln_b, pair_dim: int, hidden: int, proj_w, proj_b):
    """The "highest" wgmma passes' operands (ForwardArgs::w_in_f16x3 .. f16x3_scales): the three
    weight matrices split, and the F16x3Scale factors. A LayerNorm-ed entry is at most sqrt(K) in
    magnitude before its affine (|x_hat| <= sqrt(K - 1)), so the input rows' bound is sqrt(C) max|w| +
    max|b| and z's sqrt(H); the contraction operands a and b (proj * sigmoid * mask, with a mask of
    at most 1) are at most that bound times ||proj row||_1 plus |proj bias|. The scales take each
    operand's largest possible value to at most 2^12, so no fp16 value overflows (65504) and the
    remainders of all but negligible values stay normal. out_gate's source rows have no such bound:
    the kernel scales each on its own."""
    w_in16, t_in = _f16x3_split(w_in)
    w_gate16, t_gate = _f16x3_split(w_gate)
    w_out16, t_out = _f16x3_split(w_out)
    row_bound = math.sqrt(pair_dim) * ln_w.abs().amax() + ln_b.abs().amax()
    s_in = _power_of_two_to_4096(row_bound)
    s_z = _power_of_two_to_4096(torch.tensor(math.sqrt(hidden), device=w_in.device))
    s_ab = _power_of_two_to_4096((row_bound * proj_w.abs().sum(1) + proj_b.abs()).amax())
    exponents = torch.stack([s_in, s_in + t_in, -(s_in + t_in), -t_gate, s_z, s_z + t_out, -(s_z + t_out), s_ab,
                             -2 * s_ab])
    return [w_in16, w_gate16, w_out16, torch.exp2(exponents).float().contiguous()]


def _round_mantissa(t: torch.Tensor, kept: int) -> torch.Tensor:
    """fp32 values rounded to `kept` mantissa bits, nearest with ties away from zero as the kernels'
    cvt.rna does: add half of the dropped bits' range to the magnitude, then cut."""
    dropped = 23 - kept
    bits = t.contiguous().view(torch.int32)
    return ((bits + (1 << (dropped - 1))) & -(1 << dropped)).view(torch.float32)


def _round_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to TF32 (10 mantissa bits), as the kernels' cvt.rna does."""
    return _round_mantissa(t, 10)


def _extension_arguments(variant, mode, incoming, gate_normalized, eps_in, eps_out):
    """The extension's forward arguments after (pair, mask, weights)."""
    return (variant, _MODE_CODE[mode], incoming, gate_normalized, eps_in, eps_out)


def _fused_call(pair, mask, weights, *options):
    arguments = _extension_arguments(*options)
    variant, mode = options[:2]
    if variant not in VARIANTS or VARIANTS[variant].backend != "torch":
        return _extension().forward(pair, mask, weights, *arguments)
    # The cuBLAS baseline reads the global setting: give it the one this mode stands for.
    with _float32_matmul_precision(_MODE_PRECISION.get(mode, "medium")):
        return _extension().forward(pair, mask, weights, *arguments)


@torch.library.custom_op("trimul_inline::fused_forward", mutates_args=())
def fused_forward(pair: torch.Tensor, mask: torch.Tensor, weights: list[torch.Tensor], variant: str,
                  mode: str, incoming: bool, gate_normalized: bool, eps_in: float,
                  eps_out: float) -> torch.Tensor:
    """The whole forward on prepared weights (see prepare_weights); no autograd."""
    return _fused_call(pair, mask, weights, variant, mode, incoming, gate_normalized, eps_in,
                       eps_out)


@fused_forward.register_fake
def _fused_forward_fake(pair, mask, weights, variant, mode, incoming, gate_normalized, eps_in,
                        eps_out):
    return torch.empty_like(pair, memory_format=torch.contiguous_format)


# ------------------------------------------------------------------------------------------------
# ModelNew
# ------------------------------------------------------------------------------------------------
def _float32_matmul_precision_now() -> str:
    return torch.get_float32_matmul_precision()


_FITS = {}  # (extension, device, pair_dim, hidden, mode) -> whether the fused kernels take it


def _fused_fits_now(pair_dim: int, hidden: int, mode: str) -> bool:
    extension = _extension()
    key = (extension.__name__, torch.cuda.current_device(), pair_dim, hidden, mode)
    if key not in _FITS:
        _FITS[key] = bool(extension.fused_fits(pair_dim, hidden, _MODE_CODE[mode]))
    return _FITS[key]


# Under torch.compile these are read once, at trace time (dynamo cannot trace into them).
_float32_matmul_precision_now = torch.compiler.assume_constant_result(_float32_matmul_precision_now)
_fused_fits_now = torch.compiler.assume_constant_result(_fused_fits_now)

_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FUSED_MASK_DTYPES = (torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32,
                      torch.bfloat16, torch.float16)  # read as they are by the fused kernels
_cpu_fallback_warned = False


def check_inputs(layers: _TriMulLayers, pair_repr, pair_mask) -> None:
    """Raises ValueError/TypeError naming the problem; silent for good input."""
    for name, value in (("pair_repr", pair_repr), ("pair_mask", pair_mask)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    shape = tuple(pair_repr.shape)
    if pair_repr.dim() != 4:
        raise ValueError(f"pair_repr must have shape (B, N, N, C); got {shape} ({pair_repr.dim()}-D)")
    batch, n_rows, n_cols, channels = shape
    if n_rows != n_cols:
        raise ValueError(f"pair_repr must be (B, N, N, C) with equal middle dims; got {shape}")
    if channels != layers.pair_dim:
        raise ValueError(f"pair_repr has C={channels} channels but the model has "
                         f"pair_dim={layers.pair_dim}")
    if tuple(pair_mask.shape) != (batch, n_rows, n_cols):
        raise ValueError(f"pair_mask must have shape (B, N, N) = {(batch, n_rows, n_cols)} to match "
                         f"pair_repr {shape}; got {tuple(pair_mask.shape)}")
    if not pair_repr.is_floating_point():
        raise TypeError(f"pair_repr must be a floating-point tensor; got {pair_repr.dtype}")
    if pair_mask.is_complex():
        raise TypeError(f"pair_mask must be bool, integer or floating; got {pair_mask.dtype}")
    if pair_mask.device != pair_repr.device:
        raise ValueError(f"pair_mask is on {pair_mask.device} but pair_repr is on "
                         f"{pair_repr.device}; put both on one device")
    weight = layers.proj_a.weight
    if weight.device != pair_repr.device:
        raise ValueError(f"pair_repr is on {pair_repr.device} but the model's parameters are on "
                         f"{weight.device}; call model.to({str(pair_repr.device)!r})")
    if pair_repr.is_cuda:
        if pair_repr.dtype not in _CUDA_DTYPES:
            raise TypeError(f"pair_repr dtype {pair_repr.dtype} is not supported by the CUDA "
                            "kernels (float32, bfloat16, float16); use Model for float64")
        if pair_repr.dtype != weight.dtype and not torch.is_autocast_enabled("cuda"):
            raise TypeError(f"pair_repr is {pair_repr.dtype} but the parameters are {weight.dtype}; "
                            f"convert the model (model.to({pair_repr.dtype})) or use torch.autocast")


def _contraction_layout(t: torch.Tensor, direction: str) -> torch.Tensor:
    """[B, N, N, H] projections -> [B*H, i, k] so both directions are one a @ b^T per (b, h)."""
    batch, n, _, hidden = t.shape
    order = (0, 3, 1, 2) if direction == "outgoing" else (0, 3, 2, 1)
    return t.permute(order).contiguous().view(batch * hidden, n, n)


class ModelNew(_TriMulLayers):
    """Model's computation with the triangle contraction on a CUDA kernel from kernels/.

    kernel: a name in VARIANTS, or "auto" (the fastest that supports the call).
    precision: for fp32 inputs, "highest" | "high" | "medium"; None follows
        torch.get_float32_matmul_precision(). bf16/fp16 inputs compute in their dtype.
    On CPU tensors it runs the reference computation (and warns once).
    """

    def __init__(self, pair_dim: int, hidden_dim: int, direction: str = "outgoing",
                 gate_input: str = "raw", kernel: str = "auto", precision: Optional[str] = None):
        super().__init__(pair_dim, hidden_dim, direction, gate_input)
        if kernel != "auto" and kernel not in VARIANTS:
            raise ValueError(f"kernel must be 'auto' or one of {sorted(VARIANTS)}, got {kernel!r}")
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"precision must be None or one of {PRECISIONS}, got {precision!r}")
        self.kernel, self.precision = kernel, precision
        self._weights_cache = {}  # mode -> (parameter versions, prepared weights); not state
        self._plans = {}  # call signature -> extension arguments after the weights (see _plan_key)
        self._fast = None  # the last planned signature's decisions, checked in C++ (_fast_plan)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel={self.kernel!r}, precision={self.precision!r}"

    def resolved_precision(self) -> str:
        return self.precision or _float32_matmul_precision_now()

    def __getstate__(self):
        # (copy.deepcopy, pickle) the C++ plan does not copy; the copy plans its own calls
        state = self.__dict__.copy()
        state["_fast"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_fast", None)

    def forward(self, pair_repr: torch.Tensor, pair_mask: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            fast = self._fast
            if fast is not None:
                out = fast.run(self, pair_repr, pair_mask, self.resolved_precision())
                if out is not None:
                    return out
        out = self._forward_planned(pair_repr, pair_mask)
        if out is not None:
            return out
        check_inputs(self, pair_repr, pair_mask)
        if not pair_repr.is_cuda:
            global _cpu_fallback_warned
            if not _cpu_fallback_warned:
                _cpu_fallback_warned = True
                warnings.warn("trimul_inline: ModelNew got CPU tensors; running the reference "
                              "computation (the CUDA kernels need a GPU)", stacklevel=2)
            return reference_forward(self, pair_repr, pair_mask)
        if self._needs_autograd(pair_repr):
            return self._forward_unfused(pair_repr, pair_mask)
        precision = self.resolved_precision()
        mode = compute_mode(pair_repr.dtype, precision)
        if not self._fused_fits(mode):
            return self._forward_unfused(pair_repr, pair_mask)
        return self._forward_fused(pair_repr, pair_mask, mode, precision)

    def _needs_autograd(self, pair_repr) -> bool:
        # The fused kernels are forward-only; training takes the unfused path, whose contraction
        # op has a backward.
        if not torch.is_grad_enabled():
            return False
        return pair_repr.requires_grad or any(p.requires_grad for p in self.parameters())

    def _fused_fits(self, mode: str) -> bool:
        return _fused_fits_now(self.pair_dim, self.hidden_dim, mode)

    def _plan_key(self, pair_repr, pair_mask):
        """Everything check_inputs and the path choice read, apart from the parameters (whose
        changes clear the plans): equal keys get equal decisions and extension arguments."""
        autocast = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda")
        modules = self._modules
        return (pair_repr.shape, pair_repr.dtype, pair_repr.device, pair_repr.stride(-1), pair_mask.shape,
                pair_mask.dtype, pair_mask.device, self.resolved_precision(),
                autocast, self.kernel, self.direction, self.gate_input, modules["layer_norm_in"].eps,
                modules["layer_norm_out"].eps)

    def _forward_planned(self, pair_repr, pair_mask):
        """A small forward's host path: a call whose signature was checked and planned before
        goes straight to the extension (None: take the full path, which plans it)."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or not self._plans:
            return None
        if not (isinstance(pair_repr, torch.Tensor) and isinstance(pair_mask, torch.Tensor)):
            return None
        plan = self._plans.get(self._plan_key(pair_repr, pair_mask))
        if plan is None:
            return None
        mode, arguments = plan
        weights, refreshed = self._prepared_weights_and_freshness(mode)
        if refreshed:  # parameters changed (device, dtype...): check the call again
            self._plans.clear()
            return None
        return _extension().forward(pair_repr, pair_mask, weights, *arguments)

    def refresh_weights(self) -> None:
        """Drops the kernel-layout copies of the weights. They refresh by themselves when a
        parameter is replaced or changed in place through autograd-tracked ops (optimizer steps,
        load_state_dict, copy_ under no_grad, .to()); edits through `.data` are invisible to that
        tracking, so call this after them."""
        self._weights_cache.clear()
        self._fast = None

    def _prepared_weights(self, mode: str):
        return self._prepared_weights_and_freshness(mode)[0]

    def _prepared_weights_and_freshness(self, mode: str):
        """(prepared weights, whether they were just (re)made)."""
        params = _param_list_eager(self)
        version = [(p.data_ptr(), p._version) for p in params]
        cached = self._weights_cache.get(mode)
        if cached is not None and cached[0] == version:
            return cached[1], False
        cached = self._weights_cache[mode] = (version, prepare_weights(params, mode))
        return cached[1], True

    def _forward_fused(self, pair_repr, pair_mask, mode, precision):
        original = (pair_repr, pair_mask)
        variant = select_variant(self.kernel, _MODE_OPERAND[mode], precision, pair_repr.device).name
        if self.kernel == "auto":
            variant = "auto"  # the extension picks wgmma/mma, or folds it into the output pass
        if pair_repr.stride(-1) != 1:
            pair_repr = pair_repr.contiguous()
        if pair_mask.dtype not in _FUSED_MASK_DTYPES:
            pair_mask = pair_mask.to(torch.float32)
        options = (variant, mode, self.direction == "incoming", self.gate_input == "normalized",
                   self.layer_norm_in.eps, self.layer_norm_out.eps)
        if torch.compiler.is_compiling():
            weights = prepare_weights(_param_list(self), mode)
            return fused_forward(pair_repr, pair_mask, weights, *options)
        # Eager: skip the dispatcher (its overhead is most of a small call) and reuse weights.
        weights = self._prepared_weights(mode)
        out = _fused_call(pair_repr, pair_mask, weights, *options)
        if (not torch.is_grad_enabled() and variant not in _TORCH_BACKED
                and pair_repr is original[0] and pair_mask is original[1]):
            # This signature passed check_inputs and needs no copy or conversion: plan it.
            arguments = _extension_arguments(*options)
            self._plans[self._plan_key(pair_repr, pair_mask)] = (mode, arguments)
            self._fast = self._fast_plan(pair_repr, pair_mask, precision, weights, arguments)
        return out

    def _fast_plan(self, pair_repr, pair_mask, precision, weights, arguments):
        """The C++ side of the planned path (the extension's PlannedForward): the signature and
        what _plan_key and the weights' freshness read, compared without Python per call. None
        under autocast, with parameters outside the modules' own dicts (parametrizations), or
        with an extension that lacks it."""
        planned = getattr(_extension(), "PlannedForward", None)
        if planned is None or torch.is_autocast_enabled("cuda"):
            return None
        modules = self._modules
        entries = [(modules, name, modules[name]) for name in _SUBMODULES]
        params = []
        for module, name in _PARAM_PATHS:
            owner = modules[module]._parameters
            param = owner.get(name)
            if param is None:
                return None
            entries.append((owner, name, param))
            params.append(param)
        attributes = [(None, name, getattr(self, name)) for name in ("kernel", "direction", "gate_input")]
        attributes += [(modules[name], "eps", modules[name].eps) for name in ("layer_norm_in", "layer_norm_out")]
        return planned(entries, attributes, params, pair_repr, pair_mask, precision, weights, *arguments)

    def _gated_projection(self, x, proj, gate, mask):
        p = proj(x)
        return p * torch.sigmoid(gate(x)) * mask.to(p.dtype)

    def _forward_unfused(self, pair_repr, pair_mask):
        batch, n = pair_repr.shape[:2]
        x = self.layer_norm_in(pair_repr)
        mask = pair_mask.unsqueeze(-1)
        a = self._gated_projection(x, self.proj_a, self.gate_a, mask)
        b = self._gated_projection(x, self.proj_b, self.gate_b, mask)
        precision = self.resolved_precision()
        variant = select_variant(self.kernel, a.dtype, precision, a.device)
        z = contract(_contraction_layout(a, self.direction), _contraction_layout(b, self.direction),
                     variant.name, precision)
        z = z.view(batch, self.hidden_dim, n, n).permute(0, 2, 3, 1)
        o = self.out_proj(self.layer_norm_out(z))
        gate_source = pair_repr if self.gate_input == "raw" else x
        return torch.sigmoid(self.out_gate(gate_source)) * o


# ------------------------------------------------------------------------------------------------
# Notebook bundle and command line
# ------------------------------------------------------------------------------------------------
_EMBED_LINE = re.compile(r"^_EMBEDDED_KERNELS = None\b.*$", re.M)


def _python_literal(text: str) -> str:
    if "'''" not in text and not text.endswith("\\"):
        return "r'''" + text + "'''"
    return repr(text)


def bundle_source(kernel_dir: Optional[str] = None) -> str:
    """This module's source with every kernel file embedded: one file that needs no kernels/."""
    here = globals().get("__file__")
    if not here:
        raise RuntimeError("trimul_inline: bundle needs the module's own file (it has no __file__)")
    with open(here, encoding="utf-8") as f:
        module_text = f.read()
    sources = kernel_sources(kernel_dir)
    body = ",\n".join(f"    {name!r}: {_python_literal(text)}" for name, text in sources.items())
    embedded = "_EMBEDDED_KERNELS = {\n" + body + ",\n}  # embedded by `trimul_inline.py bundle`"
    module_text, count = _EMBED_LINE.subn(lambda _: embedded, module_text, count=1)
    if count != 1:
        raise RuntimeError("trimul_inline: bundle could not find the _EMBEDDED_KERNELS line")
    header = ("# Generated by `python trimul_inline.py bundle`: trimul_inline with its CUDA kernels "
              "embedded.\n# Edit trimul_inline.py and kernels/ instead, then bundle again.\n")
    return header + module_text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="trimul_inline.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    bundle = sub.add_parser("bundle", help="write one self-contained file with the kernels embedded")
    bundle.add_argument("-o", "--output", default="trimul_notebook.py")
    sub.add_parser("build", help="compile the CUDA extension now (or reuse the cached build)")
    args = parser.parse_args(argv)
    if args.command == "bundle":
        text = bundle_source()
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.output} ({len(text)} bytes); exec it or paste it into a notebook cell")
    else:
        module = load_extension(verbose=True if _verbose() else None)
        print(f"{module.__name__}: {module.__file__}")
        print("kernels:", ", ".join(module.contraction_variants()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
