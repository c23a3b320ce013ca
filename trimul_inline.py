"""trimul_inline — AlphaFold's triangle multiplicative update with JIT-compiled CUDA kernels.

    from trimul_inline import Model, ModelNew
    model = ModelNew(pair_dim=128, hidden_dim=128).cuda()        # same parameters as Model
    out = model(pair_repr, pair_mask)                            # (B, N, N, C)

`Model` is the reference (plain PyTorch). `ModelNew` has the same parameters and state_dict keys
and runs the forward as three kernel roles from kernels/ (input pass, contraction, output pass),
each chosen from the registry (kernels/registry.def) or by `kernels=`. The kernels compile on
first use, file by file, into a shared library that the torch extension (kernels/bindings.cpp)
loads; both are cached on disk by content (TRIMUL_VERBOSE=1 shows the build).

    python trimul_inline.py build                          # compile now, print where it went
    python trimul_inline.py kernels                        # every kernel of every role
    python trimul_inline.py bundle -o trimul_notebook.py   # one self-contained file for notebooks
"""
import argparse
import concurrent.futures
import contextlib
import errno
import glob
import hashlib
import importlib.machinery
import importlib.util
import inspect
import itertools
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
import zlib
from typing import Callable, Mapping, NamedTuple, Optional

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = [
    "Model", "ModelNew", "Kernels", "KernelEntry", "ROLES", "parse_kernels", "kernel_registry",
    "contract", "load_extension", "reload_extension", "kernel_sources", "find_toolkit", "bundle_source",
    "reference_forward", "check_inputs", "from_module", "replace_modules", "shard_rows",
]

# The oldest torch built and tested (the GPU machine's): the ops need torch.library.custom_op (2.4), the
# backward mixed-dtype GEMMs (mm / addmm with out_dtype, added after 2.7); releases in between were not tried.
MIN_TORCH = (2, 11)


# torch.optim steps taken in this process (a global post-step hook). A fused optimizer (fused=True) writes the
# parameters without bumping their version counters, so the kernel-layout weights cached by (address,
# version) take any optimizer step as a change of every parameter (ModelNew._prepared_weights_and_freshness).
_OPTIMIZER_STEPS = [0]


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    _OPTIMIZER_STEPS[0] += 1


def _check_torch_version(version: str) -> None:
    """An ImportError naming the need where `version` (torch.__version__) is older than MIN_TORCH."""
    numbers = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if numbers < MIN_TORCH:
        raise ImportError(f"trimul_inline needs torch {'.'.join(map(str, MIN_TORCH))} or newer (the oldest "
                          f"tested; its GEMMs with out_dtype and torch.library.custom_op); this is torch {version}")


_check_torch_version(torch.__version__)
register_optimizer_step_post_hook(_count_optimizer_step)

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
                 gate_input: str = "raw", bias: bool = True):
        super().__init__()
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if gate_input not in GATE_INPUTS:
            raise ValueError(f"gate_input must be one of {GATE_INPUTS}, got {gate_input!r}")
        self.pair_dim, self.hidden_dim = pair_dim, hidden_dim
        self.direction, self.gate_input, self.bias = direction, gate_input, bool(bias)
        self.layer_norm_in = nn.LayerNorm(pair_dim)
        self.proj_a = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.gate_a = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.proj_b = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.gate_b = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.layer_norm_out = nn.LayerNorm(hidden_dim)
        self.out_proj = nn.Linear(hidden_dim, pair_dim, bias=bias)
        self.out_gate = nn.Linear(pair_dim, pair_dim, bias=bias)

    def extra_repr(self) -> str:
        return f"direction={self.direction!r}, gate_input={self.gate_input!r}" + ("" if self.bias else ", bias=False")


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
# The kernel registry (kernels/registry.def, which the C++ dispatch reads too) and the one way to
# choose kernels: Kernels, parsed by parse_kernels.
# ------------------------------------------------------------------------------------------------
# Every kernel role, in the order a training step runs them: the forward's three, then the backward's.
FORWARD_ROLES = ("input", "contract", "output")
BACKWARD_ROLES = ("output_backward", "contract_backward", "input_backward", "position_gemm")
ROLES = FORWARD_ROLES + BACKWARD_ROLES


class KernelEntry(NamedTuple):
    role: str
    name: str
    rank: int  # place in the role's default order, 1 first; 0: only when chosen by name
    applies: str  # when it applies
    summary: str  # what it is
    torch: bool  # a PyTorch baseline (no kernel file)


_REGISTRY_LINE = re.compile(
    r'^TRIMUL_(TORCH_)?KERNEL\(\s*(\w+)\s*,\s*(\w+)\s*,\s*(\d+)\s*,\s*"([^"]*)"\s*,\s*"([^"]*)"\s*\)\s*$', re.M)
_REGISTRIES = {}  # registry.def text -> its entries


def kernel_registry(sources: Optional[dict] = None) -> tuple:
    """Every kernel of every role, in registry.def's order (KernelEntry)."""
    text = (sources if sources is not None else _registry_source()).get("registry.def")
    if text is None:
        raise RuntimeError("trimul_inline: kernels/ has no registry.def")
    if text not in _REGISTRIES:
        entries = tuple(KernelEntry(role, name, int(rank), applies, summary, bool(torch_))
                        for torch_, role, name, rank, applies, summary in _REGISTRY_LINE.findall(text))
        lines = [line for line in text.splitlines() if line.startswith("TRIMUL_")]
        bad = [e.role for e in entries if e.role not in ROLES]
        if len(entries) != len(lines) or bad:
            raise RuntimeError(f"trimul_inline: registry.def has lines it cannot read (roles {bad}); each entry is "
                               'TRIMUL_KERNEL(role, name, rank, "applies when", "what it is") on one line')
        _REGISTRIES[text] = entries
    return _REGISTRIES[text]


def default_order(role: str, sources: Optional[dict] = None) -> list:
    """The role's kernels the default order tries, first to last."""
    return [e.name for e in sorted((e for e in kernel_registry(sources) if e.role == role and e.rank > 0),
                                   key=lambda e: e.rank)]


class Kernels(NamedTuple):
    """The kernel of each role a ModelNew runs: a registry name, or None for the role's default order
    (the first kernel that takes the call). `input` and `output` choose the fused passes' kernels;
    `contract` the contraction (in the fused forward and in the unfused path's contraction op); the
    `*_backward` roles the backward's steps (training); `position_gemm` the backward's GEMMs over positions
    (rows times a weight) at "highest"."""
    input: Optional[str] = None
    contract: Optional[str] = None
    output: Optional[str] = None
    output_backward: Optional[str] = None
    contract_backward: Optional[str] = None
    input_backward: Optional[str] = None
    position_gemm: Optional[str] = None

    def __str__(self) -> str:
        return ",".join(f"{role}={name}" for role, name in zip(ROLES, self) if name is not None) or "auto"


def parse_kernels(value, source: str = "kernels") -> Kernels:
    """The one parser of kernel choices: None or "" or "auto" (every role's default order); a Kernels;
    a mapping {role: name or None}; or a string "role=name,role=name" (TRIMUL_KERNELS and bench.py use
    it). A bad role or name raises ValueError listing the valid ones."""
    if value is None or (isinstance(value, str) and value.strip() in ("", "auto")):
        return Kernels()
    if isinstance(value, str) and value in _PARSED_KERNELS:  # (a training step parses its op's string twice)
        return _PARSED_KERNELS[value]
    text = value if isinstance(value, str) else None
    if isinstance(value, str):
        chosen = {}
        for item in value.split(","):
            role, sep, name = item.strip().partition("=")
            if not sep:
                raise ValueError(f"trimul_inline: {source}: {item.strip()!r} is not role=name (roles: "
                                 f"{', '.join(ROLES)}), e.g. 'contract=wgmma_tma,output=streamed'")
            chosen[role.strip()] = name.strip() or None
        value = chosen
    elif isinstance(value, Kernels):
        value = value._asdict()
    if not isinstance(value, Mapping):
        raise ValueError(f"trimul_inline: {source} must be None, a Kernels, a mapping {{role: name}} or a "
                         f"'role=name,...' string, got {type(value).__name__}")
    unknown = [role for role in value if role not in ROLES]
    if unknown:
        raise ValueError(f"trimul_inline: {source}: no role {unknown[0]!r}; the roles are {', '.join(ROLES)}")
    registry = kernel_registry()
    for role, name in value.items():
        if name in (None, "auto"):
            continue
        names = [e.name for e in registry if e.role == role]
        if name not in names:
            raise ValueError(f"trimul_inline: {source}: no {role} kernel {name!r}; the {role} kernels are "
                             f"{', '.join(names)} (None: the default order)")
    kernels = Kernels(**{role: (None if name == "auto" else name) for role, name in value.items()})
    if text is not None:
        _PARSED_KERNELS[text] = kernels
    return kernels


_PARSED_KERNELS = {}  # "role=name,..." -> its Kernels, once checked against the registry


def _kernels_override() -> tuple:
    """TRIMUL_KERNELS, the one environment override (for measuring without editing code), as one name or
    "" per role: the roles it names replace a module's choices. Read when a call is planned, not per call
    (under torch.compile: at trace time)."""
    return tuple(name or "" for name in parse_kernels(os.environ.get("TRIMUL_KERNELS"), "TRIMUL_KERNELS"))


def _with_override(kernels: Kernels) -> Kernels:
    override = _kernels_override()
    return Kernels(*(chosen or name for chosen, name in zip(override, kernels)))


def _is_torch_kernel(role: str, name: Optional[str]) -> bool:
    return name is not None and any(e.torch for e in kernel_registry() if e.role == role and e.name == name)


def format_registry(sources: Optional[dict] = None) -> str:
    """The registry as a table: role, name, default rank, when it applies, what it is."""
    rows = [("role", "name", "rank", "applies when", "what it is")]
    for e in kernel_registry(sources):
        rank = str(e.rank) if e.rank > 0 else "-"
        rows.append((e.role, e.name + (" (torch)" if e.torch else ""), rank, e.applies, e.summary))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}\n"
                     f"{'':<{widths[0] + widths[1] + widths[2] + 6}}{r[4]}" if i else
                     f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]} / {r[4]}"
                     for i, r in enumerate(rows))


# ------------------------------------------------------------------------------------------------
# Kernel sources, toolkit discovery and the build cache. Each kernels/*.cu compiles on its own (nvcc,
# in parallel, cached by the content of the file and the headers it includes) into an object; the
# objects link into the kernel library; bindings.cpp alone is the torch extension, which loads the
# library at run time. An edit to one kernel file recompiles that file and relinks, nothing else.
# ------------------------------------------------------------------------------------------------
_EMBEDDED_KERNELS = None  # `python trimul_inline.py bundle` replaces this with {file name: text}
_KERNEL_SUFFIXES = (".cu", ".cuh", ".cpp", ".h", ".def")
_HOST_SOURCE = "bindings.cpp"
# (-fno-gnu-unique: the headers' inline functions keep their static caches per library, not one per process
# shared by every kernel library a process loads, RTLD_LOCAL or not)
_NVCC_FLAGS = ("-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC,-fno-gnu-unique")
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
    for required in (_HOST_SOURCE, "registry.def"):
        if required not in sources:
            raise RuntimeError(f"trimul_inline: {kernel_dir} has no {required}")
    return sources


def _registry_source() -> dict:
    """{"registry.def": its text} alone, read again only when the file changes: kernel_registry runs on per-call
    paths (a named kernel's checks), where kernel_sources would read every kernel file."""
    if _EMBEDDED_KERNELS is not None:
        return {"registry.def": _EMBEDDED_KERNELS.get("registry.def")}
    path = os.path.join(_default_kernel_dir(), "registry.def")
    try:
        stat = os.stat(path)
    except OSError:
        return {}
    version = (stat.st_mtime_ns, stat.st_size)
    cached = _REGISTRY_FILES.get(path)
    if cached is None or cached[0] != version:
        with open(path, encoding="utf-8") as f:
            cached = _REGISTRY_FILES[path] = (version, {"registry.def": f.read()})
    return cached[1]


_REGISTRY_FILES = {}  # registry.def's path -> ((mtime, size), {"registry.def": text})


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def local_includes(name: str, sources: dict) -> tuple:
    """The kernels/ files `name` includes, directly or through others, sorted."""
    found, pending = set(), [name]
    while pending:
        current = pending.pop()
        for header in _LOCAL_INCLUDE.findall(sources[current]):
            if header not in sources:
                raise RuntimeError(f"trimul_inline: kernels/{current} includes {header!r}, which is not in kernels/")
            if header not in found:
                found.add(header)
                pending.append(header)
    return tuple(sorted(found))


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


# The kernels' oldest GPU: tf32 conversions and bf16 mma.sync are sm_80 instructions. Older GPUs (a T4, sm_75) run
# ModelNew as the reference computation, and a build for them is refused before nvcc runs.
MIN_COMPUTE_CAPABILITY = (8, 0)


def target_arch() -> str:
    """nvcc arch suffix: the current GPU's (sm_90a on Hopper, for wgmma); 90a with no GPU. A RuntimeError for a
    GPU or TRIMUL_CUDA_ARCH below MIN_COMPUTE_CAPABILITY."""
    env = os.environ.get("TRIMUL_CUDA_ARCH")
    if env:
        arch, source = env, f"TRIMUL_CUDA_ARCH={env}"
    elif torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        arch, source = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else ""), "this GPU"
    else:
        return "90a"
    digits = re.match(r"\d+", arch)
    if digits is None or len(digits.group()) < 2:
        raise RuntimeError(f"trimul_inline: {source}: not an nvcc arch (e.g. 80, 90a, 100)")
    if (int(digits.group()[:-1]), int(digits.group()[-1])) < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(f"trimul_inline: the CUDA kernels need compute capability "
                           f"{'.'.join(map(str, MIN_COMPUTE_CAPABILITY))} or newer; {source} is sm_{arch}. On "
                           f"such a GPU ModelNew runs the PyTorch reference computation without building them.")
    return arch


def _kernels_run_on(device_index: int) -> bool:
    """Whether CUDA device `device_index` is one the kernels are for (MIN_COMPUTE_CAPABILITY and newer)."""
    if device_index not in _KERNEL_DEVICES:
        _KERNEL_DEVICES[device_index] = torch.cuda.get_device_capability(device_index) >= MIN_COMPUTE_CAPABILITY
    return _KERNEL_DEVICES[device_index]


_KERNEL_DEVICES = {}


def _digest(*parts) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update((part if isinstance(part, str) else repr(part)).encode() + b"\0")
    return digest.hexdigest()[:16]


# nvcc reads these from the environment: flags and host compiler that change the objects it writes.
_NVCC_ENVIRONMENT = ("NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_CCBIN")
_NVCC_IDENTITIES = {}  # nvcc path -> its version line


def _nvcc_identity(home: str) -> str:
    """nvcc's own version line ("Build cuda_13.0.r13.0/compiler...": the updates of one release share a
    CUDART_VERSION), once per process; "" where it does not run (the tests' fake toolkits)."""
    nvcc = os.path.join(home, "bin", "nvcc")
    if nvcc not in _NVCC_IDENTITIES:
        try:
            lines = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout.split("\n")
            _NVCC_IDENTITIES[nvcc] = next((line for line in reversed(lines) if line.strip()), "")
        except (OSError, subprocess.SubprocessError):
            _NVCC_IDENTITIES[nvcc] = ""
    return _NVCC_IDENTITIES[nvcc]


def toolkit_identity(toolkit: "Toolkit") -> str:
    """What the objects depend on of the toolkit and the machine: CUDART_VERSION, nvcc's build, nvcc's
    environment flags, the CPU architecture (a cache shared by x86_64 and aarch64 hosts)."""
    return "|".join([toolkit.version, _nvcc_identity(toolkit.home), platform.machine()]
                    + [os.environ.get(name, "") for name in _NVCC_ENVIRONMENT])


def object_key(name: str, sources: dict, arch: str, toolkit_version: str) -> str:
    """Hash of everything one kernel file's object depends on: its text, its headers', the flags, the toolkit
    (toolkit_identity)."""
    files = (name,) + local_includes(name, sources)
    return _digest(*(f + "\0" + sources[f] for f in files), _NVCC_FLAGS, arch, toolkit_version)


def host_key(sources: dict, toolkit_version: str) -> str:
    """Hash of everything the torch extension depends on: bindings.cpp, its headers, torch, Python."""
    files = (_HOST_SOURCE,) + local_includes(_HOST_SOURCE, sources)
    return _digest(*(f + "\0" + sources[f] for f in files), _CXX_FLAGS, torch.__version__, torch.version.cuda,
                   toolkit_version, sys.implementation.cache_tag, sysconfig.get_config_var("EXT_SUFFIX"))


def extensions_root() -> str:
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions", "trimul_inline")


def _verbose() -> bool:
    return os.environ.get("TRIMUL_VERBOSE", "0").strip().lower() not in ("", "0", "false", "no", "off")


def _say(message: str) -> None:
    print(f"trimul_inline: {message}", file=sys.stderr, flush=True)


class BuildPlan(NamedTuple):
    root: str
    arch: str
    toolkit: Toolkit
    sources: dict
    objects: tuple  # (kernel file, object path) for each .cu
    library: str  # the kernel library (all objects linked)
    host_name: str  # the torch extension (bindings.cpp)
    host_dir: str
    host_so: str


def plan_build(kernel_dir: Optional[str] = None) -> BuildPlan:
    sources = kernel_sources(kernel_dir)
    toolkit = find_toolkit()
    arch = target_arch()
    root = extensions_root()
    identity = toolkit_identity(toolkit)
    objects = tuple((name, os.path.join(root, "objects", f"{name[:-3]}-{object_key(name, sources, arch, identity)}.o"))
                    for name in sorted(sources) if name.endswith(".cu"))
    library = os.path.join(root, f"libtrimul_kernels-{_digest(*objects)}.so")
    host_name = f"trimul_inline_{host_key(sources, identity)}"
    host_dir = os.path.join(root, host_name)
    return BuildPlan(root, arch, toolkit, sources, objects, library, host_name, host_dir,
                     os.path.join(host_dir, host_name + ".so"))


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


_STALE_TEMPORARY_S = 3600  # a build's temporary file older than this was left by a killed build


def _write_atomically(path: str, write) -> None:
    """write(temporary path), then the temporary file renamed to `path` (another process may build it too).
    Temporaries of `path` that a killed build left (older than _STALE_TEMPORARY_S) are removed first."""
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise OSError(f"trimul_inline: cannot create the build cache folder {folder} ({error}); set "
                      "TORCH_EXTENSIONS_DIR to a writable place") from error
    for old in glob.glob(glob.escape(path) + ".*.tmp"):
        try:
            if time.time() - os.path.getmtime(old) > _STALE_TEMPORARY_S:
                os.remove(old)
        except OSError:
            pass
    temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        write(temporary)
        os.replace(temporary, path)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise
        raise OSError(error.errno, f"trimul_inline: writing {path} failed ({error.strerror}); the build cache is "
                      f"TORCH_EXTENSIONS_DIR ({extensions_root()}): free space there or point it elsewhere") from error
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _source_snapshot(plan: BuildPlan) -> str:
    """A folder holding this build's kernel sources as hashed (the objects compile from it, so an edit
    made during a build cannot land in an object keyed by the text before it)."""
    folder = os.path.join(plan.root, "sources", os.path.basename(plan.library)[len("libtrimul_kernels-"):-3])
    if not os.path.isfile(os.path.join(folder, ".complete")):
        for name, text in plan.sources.items():
            def write(path, text=text):
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
            _write_atomically(os.path.join(folder, name), write)
        with open(os.path.join(folder, ".complete"), "w") as f:
            f.write("")
    return folder


def _run(command: list, what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"trimul_inline: {what} failed:\n{' '.join(command)}\n{result.stdout}{result.stderr}")


def _compile_object(plan: BuildPlan, snapshot: str, name: str, path: str, verbose: bool) -> None:
    source = os.path.join(snapshot, name)
    nvcc = os.path.join(plan.toolkit.home, "bin", "nvcc")
    flags = list(_NVCC_FLAGS) + [f"-gencode=arch=compute_{plan.arch},code=sm_{plan.arch}"]
    if verbose:
        _say(" ".join([nvcc, *flags, "-c", source, "-o", path]))
    _write_atomically(path, lambda out: _run([nvcc, *flags, "-c", source, "-o", out], f"compiling kernels/{name}"))
    if verbose:
        _say(f"compiled kernels/{name}")


def _cudart_link_flags(toolkit: Toolkit) -> list:
    """The shared CUDA runtime, the one torch loads (a static one would keep its own current device)."""
    for lib_dir in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"),
                    os.path.join("targets", "sbsa-linux", "lib")):
        if os.path.exists(os.path.join(toolkit.home, lib_dir, "libcudart.so")):
            return ["-cudart", "shared", f"-L{os.path.join(toolkit.home, lib_dir)}"]
    for lib_dir in toolkit.extra_lib_dirs:
        found = sorted(glob.glob(os.path.join(lib_dir, "libcudart.so*")))
        if found:
            return ["-cudart", "none", found[0]]
    raise RuntimeError(f"trimul_inline: no libcudart.so in {toolkit.home} or pip's nvidia wheels")


def _link_library(plan: BuildPlan, verbose: bool) -> None:
    nvcc = os.path.join(plan.toolkit.home, "bin", "nvcc")
    objects = [path for _, path in plan.objects]
    _write_atomically(plan.library, lambda out: _run(
        [nvcc, "-shared", f"-gencode=arch=compute_{plan.arch},code=sm_{plan.arch}", *objects, "-o", out,
         *_cudart_link_flags(plan.toolkit)], "linking the kernel library"))
    if verbose:
        _say(f"linked {plan.library}")


def _compile_host(plan: BuildPlan, verbose: bool):
    import inspect
    from torch.utils import cpp_extension
    host = _inline_includes(_HOST_SOURCE, plan.sources, set())
    os.makedirs(plan.host_dir, exist_ok=True)
    cxx_flags = list(_CXX_FLAGS) + [f"-idirafter{d}" for d in plan.toolkit.extra_includes]
    ldflags = [f"-L{d}" for d in plan.toolkit.extra_lib_dirs] + ["-ldl"]
    kwargs = {}
    if "no_implicit_headers" in inspect.signature(cpp_extension.load_inline).parameters:
        kwargs["no_implicit_headers"] = True
    with _torch_cuda_home(plan.toolkit.home):
        # (no CUDA sources, but torch reads the arch from extra_cuda_cflags, else from a GPU it may not find)
        module = cpp_extension.load_inline(
            name=plan.host_name, cpp_sources=[host], extra_cflags=cxx_flags, extra_ldflags=ldflags,
            extra_cuda_cflags=[f"-gencode=arch=compute_{plan.arch},code=sm_{plan.arch}"],
            build_directory=plan.host_dir, verbose=verbose, with_cuda=True, **kwargs)
    with open(plan.host_so + ".ok", "w") as f:  # written only after a build finished and imported
        f.write(plan.host_name + "\n")
    return module


def _import_host(plan: BuildPlan):
    loader = importlib.machinery.ExtensionFileLoader(plan.host_name, plan.host_so)
    spec = importlib.util.spec_from_file_location(plan.host_name, plan.host_so, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _host_built(plan: BuildPlan) -> bool:
    return os.path.exists(plan.host_so) and os.path.exists(plan.host_so + ".ok")


def _build(plan: BuildPlan, verbose: bool):
    """The torch extension (imported) and the kernel library, each built where its cache lacks it: the
    missing objects compile in parallel, beside the extension."""
    missing = [(name, path) for name, path in plan.objects if not os.path.exists(path)]
    build_host = not _host_built(plan)
    if verbose:
        if missing or build_host or not os.path.exists(plan.library):
            _say(f"building for sm_{plan.arch} with {plan.toolkit.home} (CUDA {plan.toolkit.version}) in "
                 f"{plan.root}: {len(missing)} of {len(plan.objects)} kernel files"
                 f"{', the extension' if build_host else ''}")
        else:
            _say(f"reusing cached build {plan.library} and {plan.host_so}")
    start = time.perf_counter()
    # Longest first (the largest files), so the last to finish is not a long one started late.
    missing.sort(key=lambda item: -len(plan.sources[item[0]]))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        host = pool.submit(_compile_host, plan, verbose) if build_host else None
        snapshot = _source_snapshot(plan) if missing else None
        compiled = [pool.submit(_compile_object, plan, snapshot, name, path, verbose) for name, path in missing]
        try:
            for future in concurrent.futures.as_completed(compiled):
                future.result()  # (the first error as soon as its compile ends, not after the rest)
        except BaseException:
            for future in compiled:
                future.cancel()
            raise
        if not os.path.exists(plan.library):
            _link_library(plan, verbose)
        module = host.result() if host is not None else _import_host(plan)
    if verbose and (missing or build_host):
        _say(f"built in {time.perf_counter() - start:.1f} s")
    return module


def _check_registry(module, sources: dict) -> None:
    """The library's kernels against registry.def: each entry compiled, each compiled kernel an entry."""
    compiled = module.kernels()
    problems = [f"kernels/ registers {role} kernel {name!r}, which registry.def does not list"
                for role, name, _, _, in_registry, *_ in compiled if not in_registry]
    problems += [f"registry.def lists {role} kernel {name!r}, which no kernel file registers"
                 for role, name, _, torch_, in_registry, built, *_ in compiled
                 if in_registry and not torch_ and not built]
    listed = [(role, name, rank) for role, name, rank, _, in_registry, *_ in compiled if in_registry]
    if listed != [(e.role, e.name, e.rank) for e in kernel_registry(sources)]:
        problems.append("the library read another registry.def than this module")
    if problems:
        raise RuntimeError("trimul_inline: the registry and the compiled kernels disagree: " + "; ".join(problems))


_LOADED = {}  # (extension, kernel library) -> the extension module, for this process
_DEFAULT_EXTENSION = None


def load_extension(kernel_dir: Optional[str] = None, verbose: Optional[bool] = None):
    """The torch extension with the kernel library of these sources attached: memoized, else the cached
    builds, else built. The extension runs the library of the last load_extension call
    (module.kernel_library names it)."""
    verbose = _verbose() if verbose is None else verbose
    plan = plan_build(kernel_dir)
    key = (plan.host_so, plan.library)
    module = _LOADED.get(key)
    if module is None:
        module = _build(plan, verbose)
        module.attach_kernels(plan.library)
        module.kernel_library = plan.library
        _check_registry(module, plan.sources)
        _LOADED[key] = module
    elif getattr(module, "kernel_library", None) != plan.library:
        module.attach_kernels(plan.library)
        module.kernel_library = plan.library
    return module


def reload_extension(verbose: Optional[bool] = None):
    """Re-read kernels/, rebuild what changed, and use the result from now on."""
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


def contract_into(z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, kernel: Optional[str],
                  precision: str) -> torch.Tensor:
    """Writes z = a @ b^T by the named contraction kernel (None or "": the default order); no autograd."""
    if _is_torch_kernel("contract", kernel):
        with _float32_matmul_precision(precision):
            torch.bmm(a, b.transpose(1, 2), out=z) if z.dtype == a.dtype else \
                z.copy_(torch.bmm(a, b.transpose(1, 2)))
        return z
    if z.data_ptr() % 16:  # (the kernels store z in 8- and 16-byte pairs from its start)
        raise ValueError("trimul_inline: z must start on a 16-byte boundary (a fresh tensor does); got an offset "
                         f"of {z.data_ptr() % 16} bytes")
    _extension().contract(kernel or "", a, b, z, _PRECISION_CODE[precision])
    return z


@torch.library.custom_op("trimul_inline::contract", mutates_args=())
def contract(a: torch.Tensor, b: torch.Tensor, kernel: str, precision: str) -> torch.Tensor:
    """z = a @ b^T for a [batch, m, k], b [batch, n, k] (contiguous CUDA); z has a's dtype. kernel: a
    contraction kernel's name, or "" for the default order."""
    z = a.new_empty((a.shape[0], a.shape[1], b.shape[1]))
    return contract_into(z, a, b, kernel, precision)


@contract.register_fake
def _contract_fake(a, b, kernel, precision):
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
# The fused forward: input pass -> contraction -> output pass, one extension call; or its steps
# ------------------------------------------------------------------------------------------------
# Compute modes of the fused kernels (trimul::Mode): 16-bit operands, or fp32 inputs at "high" / "highest".
_MODE_CODE = {"bf16": 0, "f16": 1, "high": 2, "highest": 3}
_MODE_OPERAND = {"bf16": torch.bfloat16, "f16": torch.float16, "high": torch.float32, "highest": torch.float32}
_MODE_PRECISION = {"bf16": "medium", "f16": "medium", "high": "high", "highest": "highest"}
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # (trimul::Dtype)


def compute_mode(pair_dtype: torch.dtype, precision: str) -> str:
    """bf16/fp16 inputs compute in their dtype; fp32 inputs follow autocast, else `precision`."""
    if pair_dtype == torch.bfloat16:
        return "bf16"
    if pair_dtype == torch.float16:
        return "f16"
    if torch.is_autocast_enabled("cuda"):
        return "bf16" if torch.get_autocast_dtype("cuda") == torch.bfloat16 else "f16"
    return "bf16" if precision == "medium" else precision


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


_PARAM_PATHS = (("layer_norm_in", "weight"), ("layer_norm_in", "bias"), ("proj_a", "weight"),
                ("proj_a", "bias"), ("gate_a", "weight"), ("gate_a", "bias"), ("proj_b", "weight"),
                ("proj_b", "bias"), ("gate_b", "weight"), ("gate_b", "bias"),
                ("layer_norm_out", "weight"), ("layer_norm_out", "bias"), ("out_proj", "weight"),
                ("out_proj", "bias"), ("out_gate", "weight"), ("out_gate", "bias"))
_SUBMODULES = tuple(dict.fromkeys(module for module, _ in _PARAM_PATHS))


def _param_list(layers: "_TriMulLayers"):
    """The 16 parameters in prepare_weights' order (through nn.Module attributes: traceable); None for a
    Linear without bias. A module running another model's layer (`_source`, see replace_modules) reads
    that layer's tensors instead."""
    source = layers.__dict__.get("_source")
    if source is not None:
        return source()
    return [getattr(getattr(layers, module), name) for module, name in _PARAM_PATHS]


def _param_list_eager(layers: "_TriMulLayers"):
    """_param_list by direct dict lookups (nn.Module.__getattr__ costs ~1 us a call, a good part of
    a small forward); falls back for modules whose parameters live elsewhere (parametrizations), and is
    _param_list itself under torch.compile (what dynamo traces)."""
    if torch.compiler.is_compiling():
        return _param_list(layers)
    try:
        if layers.__dict__.get("_source") is None:
            modules = layers._modules
            return [modules[module]._parameters[name] for module, name in _PARAM_PATHS]
    except KeyError:
        pass
    return _param_list(layers)


def _with_zero_biases(params):
    """The parameter list with zeros for the biases of Linears that have none (bias=False): what the kernels
    and the backward take (the biases fold into vectors they read anyway, with LayerNorm's)."""
    filled = list(params)
    for i, (module, name) in enumerate(_PARAM_PATHS):
        if filled[i] is None:
            weight = filled[i - 1]
            filled[i] = weight.new_zeros(weight.shape[0])
    return filled


def prepare_weights(params, mode: str):
    """The layout the fused kernels stream: fp32 norms and biases; weights in the operand type,
    k padded to 32 and rows to 128 with zeros; proj/gate rows in groups of 16 (rows 16g + e = proj
    and 16g + 8 + e = gate of h = 8g + e), so the input pass's mma fragment rows g and g + 8 hold
    both halves of one gated output. LayerNorm_out's weight and bias are folded into out_proj's
    weight and bias. The 16-bit modes add the register-row input kernels' weights
    (_register_row_weights), the fp32 modes (high, highest) the wgmma passes' scaled fp16 operands
    (_f16x3_weights). The order is bindings.cpp's forward_args'."""
    (ln_in_w, ln_in_b, pa_w, pa_b, ga_w, ga_b, pb_w, pb_b, gb_w, gb_b, ln_out_w, ln_out_b,
     out_w, out_b, gate_w, gate_b) = [p.detach() for p in _with_zero_biases(params)]
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
    as_operand = (lambda t: _round_to_tf32(t)) if mode == "high" else (lambda t: t.to(operand))
    w_in = torch.cat([wa, wb])
    prepared = [as_f32(ln_in_w), as_f32(ln_in_b), as_operand(w_in), torch.cat([ba, bb]), as_operand(w_gate),
                as_f32(gate_b), as_operand(w_out), as_f32(out_b)]
    if mode in ("bf16", "f16"):  # (the input kernels with the rows in registers: ForwardArgs::w_in_rows)
        prepared += _register_row_weights(w_in, torch.cat([ba, bb]), ln_in_w, ln_in_b, operand)
    else:  # (the wgmma passes' scaled fp16 arithmetic: ForwardArgs::w_in_f16x3)
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
    # (a fill, not torch.tensor: no host-to-device copy, so a CUDA graph can capture it: _prepared_graphed)
    s_z = _power_of_two_to_4096(torch.full((), math.sqrt(hidden), device=w_in.device))
    s_ab = _power_of_two_to_4096((row_bound * proj_w.abs().sum(1) + proj_b.abs()).amax())
    exponents = torch.stack([s_in, s_in + t_in, -(s_in + t_in), -t_gate, s_z, s_z + t_out, -(s_z + t_out), s_ab,
                             -2 * s_ab])
    return [w_in16, w_gate16, w_out16, torch.exp2(exponents).float().contiguous()]


# A training forward that keeps x_hat (LayerNorm_in's rows without affine: the 16-bit modes' input kernels write
# them for the backward) and whose gate reads the normalized input runs its output pass with the gate on x_hat as
# a raw gate, LayerNorm_in's affine folded into out_gate: the same gate, sigmoid(x_hat (W diag(w))^T + b + W b_ln),
# with no LayerNorm in the pass, and fp32 pairs' gate reading bf16 rows. Where: an output kernel registered as
# reading gate rows takes the call (forward_plan's "gate_rows": wgmma_rs_384 at pair_dim 384, whose normalized
# gate's pass, wgmma_ws, is the slower one; wgmma_rs at pair_dim 128, its in-register LayerNorm skipped:
# bench/NOTES.md), under the output role's default order (a named output kernel runs as named).
def _gate_reads_x_hat(plan: dict, x_hat: Optional[torch.Tensor], output_kernel: Optional[str],
                      gate_normalized: bool) -> bool:
    """Whether the training forward's output pass reads x_hat as a raw gate (the rule above); plan: the forward's
    (ForwardSteps.plan)."""
    return gate_normalized and x_hat is not None and not output_kernel and plan["gate_rows"]


class _GraphedCalls:
    """CUDA graphs of functions of tensors, one per call signature (the caller's key), the `limit` most recently used
    kept. A graph copies the call's tensors into its own inputs (one multi-tensor copy), so calls of one signature on
    other tensors (every layer of a stack with the same shapes) share one graph and its memory; its outputs are
    copied out, since the next replay overwrites them. Not while a capture is under way (a caller's own graph
    captures the call) nor under a Python dispatch mode. what / instead: the call and what runs where its capture
    fails, for the warning."""

    def __init__(self, what: str, instead: str, limit: int = 8):
        self.what, self.instead, self.limit = what, instead, limit
        self.entries = {}  # key -> (inputs, graph, outputs); insertion order = recency

    def run(self, key, tensors: list, function, capture: bool = True):
        """function(tensors)'s outputs (a list of tensors and Nones) as fresh tensors, replayed from the key's
        graph; [] where function returns [] (it has nothing to capture: a torch baseline role); None where no
        graph may run now, where the key has none and capture is False, or where the key's capture failed (warned
        once per key): the caller then calls function itself. key: everything the outputs depend on besides the
        tensors' values (their shapes, dtypes and device included). The graph's inputs and every output are normal
        tensors under torch.inference_mode too (a graph captured during an evaluation replays in training), and no
        copy records autograd history (turning inference mode off turns grad mode on: no_grad after it)."""
        # (capture and replay on the tensors' device, whatever is current)
        with torch.cuda.device(tensors[0].device), torch.inference_mode(False), torch.no_grad():
            if torch.cuda.is_current_stream_capturing() or _python_dispatch_mode_active():
                return None
            if not capture and key not in self.entries:
                return None
            return self._run(key, tensors, function)

    def _run(self, key, tensors, function):
        entry = self.entries.pop(key, None)
        if entry is None:
            try:
                entry = self._capture(tensors, function)
            except RuntimeError as error:  # (something here refuses capture: the plain call for this key)
                warnings.warn(f"trimul_inline: {self.what}'s CUDA graph could not be captured ({error}); "
                              f"{self.instead} instead", stacklevel=3)
                entry = (None, None, None)
        self.entries[key] = entry
        while len(self.entries) > self.limit:
            self.entries.pop(next(iter(self.entries)))
        inputs, graph, outputs = entry
        if graph is None:
            return None if inputs is None else []
        torch._foreach_copy_(inputs, list(tensors))  # (under run's no_grad: no history recorded)
        graph.replay()
        defined = [t for t in outputs if t is not None]
        copies = [torch.empty_like(t) for t in defined]
        torch._foreach_copy_(copies, defined)
        copies.reverse()
        return [None if t is None else copies.pop() for t in outputs]

    @staticmethod
    def _capture(tensors, function):
        """(inputs, graph, outputs) for a key: one run on a side stream first (cuBLAS's handles and workspaces, the
        kernels' attributes), then the capture on that stream (torch.cuda.graph's default capture stream belongs to
        the device that captured first: another device's kernels would run outside the capture, leaving an empty
        graph); (inputs, None, None) where function returns []."""
        inputs = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
        side = torch.cuda.Stream(device=inputs[0].device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm = function(inputs)
        torch.cuda.current_stream().wait_stream(side)
        if not warm:
            return inputs, None, None
        del warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            outputs = function(inputs)
        return inputs, graph, outputs


class _CachedWeights(list):
    """prepare_weights' list as ModelNew caches it (per mode and parameter version), with the raw-gate-on-x_hat
    weights derived from it kept beside it, so that a training step does not fold them again. graphed: made from
    _WEIGHT_GRAPHS (the derived weights are made there too)."""
    x_hat_gate: Optional[list] = None
    graphed: bool = False


# Refreshing the kernel-layout weights after an optimizer step is prepare_weights' many small ATen calls of host
# time, most of a small training step's forward: a refresh replays them from a CUDA graph instead (one per signature,
# which every layer of a stack with the same shapes shares). A module's first preparation captures nothing, so
# inference (which prepares once) stays op by op. The 16-bit modes on CUDA take neither: weight_prep makes their list
# in one launch (_prepared_by_kernel), which a replay of ~50 kernels cannot match.
_WEIGHT_GRAPHS = _GraphedCalls("the weights' preparation", "it runs op by op", limit=32)  # (a few MiB each)


def _on_one_cuda_device(present: list) -> bool:
    """Whether the given parameters (None left out) are CUDA tensors on one device."""
    return all(p.is_cuda and p.device == present[0].device for p in present)


def _prepared_graphed(params: list, mode: str, capture: bool) -> Optional[list]:
    """prepare_weights(params, mode) replayed from _WEIGHT_GRAPHS (fresh tensors, bit-equal to it); None where no graph
    runs (not CUDA, a capture under way, capture False and none made yet, a failed capture)."""
    present = [p for p in params if p is not None]
    if not _on_one_cuda_device(present):
        return None
    missing = tuple(p is None for p in params)

    def prepare(inputs):
        given = iter(inputs)
        return prepare_weights([None if gone else next(given) for gone in missing], mode)
    key = ("prepare_weights", mode, missing, tuple((p.shape, p.dtype) for p in present), present[0].device)
    return _WEIGHT_GRAPHS.run(key, present, prepare, capture)


def _prepared_by_kernel(params: list, mode: str, x_hat_gate: bool) -> Optional["_CachedWeights"]:
    """prepare_weights(params, mode) from the extension's weight_prep (kernels/weight_prep.cu: one launch in place
    of ~50 tensor ops, which a training step redoes after every update; the same values but for the fp64 sums'
    order), with x_hat_gate also its raw-gate-on-x_hat weights (_x_hat_gate_weights) kept beside; None where it does
    not apply: other modes (the fp32 modes' fp16x3 splits stay tensor ops), parameters off CUDA, on several devices
    or in other dtypes, or a Python dispatch mode active (a FakeTensor trace). The tensors are normal ones even under
    torch.inference_mode (weights cached in an evaluation serve the training after it)."""
    if mode not in ("bf16", "f16") or _python_dispatch_mode_active():
        return None
    present = [p for p in params if p is not None]
    if not _on_one_cuda_device(present) or not all(p.dtype in _DTYPE_CODE for p in present):
        return None
    with torch.inference_mode(False), torch.no_grad():  # (turning inference mode off turns grad mode on)
        made = _extension().weight_prep(params, mode == "f16", x_hat_gate)
    weights = _CachedWeights(made[:9])
    if x_hat_gate:
        weights.x_hat_gate = made[:4] + made[9:] + made[6:9]
    return weights


def _x_hat_gate_parts(gate_shape, gate_dtype, ln_w, ln_b, gate_w, gate_b) -> list:
    """[out_gate's weight folded with LayerNorm_in's (W diag(w) in gate_dtype, the operand's, padded to gate_shape),
    b + W b_ln in fp32], computed in fp64: W diag(w) of fp32 values is exact there, so it rounds once, as in fp32;
    b + W b_ln is prepare_weights' out_b sum."""
    folded_w, folded_b = _folded(*(t.detach().double() for t in (gate_w, gate_b, ln_w, ln_b)))
    pair_dim = gate_w.shape[1]
    w_gate = torch.zeros(gate_shape, device=gate_w.device, dtype=gate_dtype)
    w_gate[:pair_dim, :pair_dim] = folded_w.float()
    return [w_gate, folded_b.float()]


def _x_hat_gate_weights(weights: list, params: list) -> list:
    """prepare_weights' list with out_gate folded with LayerNorm_in's affine (_x_hat_gate_parts): the weights of a raw
    gate on x_hat. Once per _CachedWeights (from _WEIGHT_GRAPHS where the weights came from there)."""
    if getattr(weights, "x_hat_gate", None) is not None:
        return weights.x_hat_gate
    sources = [params[i] for i in (0, 1, 14, 15)]
    gate = (tuple(weights[4].shape), weights[4].dtype)
    parts = None
    if getattr(weights, "graphed", False):
        key = ("x_hat_gate", gate, tuple((p.shape, p.dtype) for p in sources), sources[0].device)
        parts = _WEIGHT_GRAPHS.run(key, sources, lambda inputs: _x_hat_gate_parts(*gate, *inputs))
    if parts is None:
        parts = _x_hat_gate_parts(*gate, *sources)
    folded = list(weights[:4]) + parts + list(weights[6:])
    if isinstance(weights, _CachedWeights):
        weights.x_hat_gate = folded
    return folded


def _round_mantissa(t: torch.Tensor, kept: int) -> torch.Tensor:
    """fp32 values rounded to `kept` mantissa bits, nearest with ties away from zero as the kernels'
    cvt.rna does: add half of the dropped bits' range to the magnitude, then cut."""
    dropped = 23 - kept
    bits = t.contiguous().view(torch.int32)
    return ((bits + (1 << (dropped - 1))) & -(1 << dropped)).view(torch.float32)


def _round_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to TF32 (10 mantissa bits), as the kernels' cvt.rna does."""
    return _round_mantissa(t, 10)


def _forward_options(kernels, mode: str, incoming: bool, gate_normalized: bool, eps_in: float, eps_out: float,
                     hidden: int):
    """The extension's ForwardOptions: a module's choices for its fused forward."""
    return _extension().ForwardOptions([name or "" for name in kernels[:len(FORWARD_ROLES)]], _MODE_CODE[mode], incoming,
                                       gate_normalized, eps_in, eps_out, hidden)


def _bmm_precision(kernels, mode: str):
    """The cuBLAS baseline reads the global matmul precision: the one this mode stands for."""
    if _is_torch_kernel("contract", kernels[1]):
        return _float32_matmul_precision(_MODE_PRECISION[mode])
    return contextlib.nullcontext()


@torch.library.custom_op("trimul_inline::fused_forward", mutates_args=())
def fused_forward(pair: torch.Tensor, mask: torch.Tensor, weights: list[torch.Tensor], input_kernel: str,
                  contract_kernel: str, output_kernel: str, mode: str, incoming: bool, gate_normalized: bool,
                  eps_in: float, eps_out: float, hidden: int) -> torch.Tensor:
    """The whole forward on prepared weights (see prepare_weights); no autograd. *_kernel: a kernel of
    that role ("": its default order)."""
    return _run_fused_forward(pair, mask, weights, (input_kernel, contract_kernel, output_kernel), mode, incoming,
                              gate_normalized, eps_in, eps_out, hidden)


def _run_fused_forward(pair, mask, weights, kernels, mode, incoming, gate_normalized, eps_in, eps_out, hidden):
    """fused_forward's work, for callers already inside an op (no second dispatch)."""
    options = _forward_options(kernels, mode, incoming, gate_normalized, eps_in, eps_out, hidden)
    with _bmm_precision(kernels, mode):
        return _extension().forward(pair, mask, weights, options)


@fused_forward.register_fake
def _fused_forward_fake(pair, mask, weights, *options):
    return torch.empty_like(pair, memory_format=torch.contiguous_format)


class ForwardSteps:
    """One fused forward as its three steps on caller-provided buffers (ModelNew.forward_steps), so that a
    backward can keep a/b and z or recompute them. `plan` says each role's kernel and the buffers:
    ab [2, planes, N, ld] (a_t then b_t, the contraction's operands), z [B*H, N, ldz] (None where the
    output pass contracts itself), out like pair_repr. Steps launch on the current stream."""

    def __init__(self, pair, mask, weights, options, mode):
        self._call = (pair, mask, weights, options)
        self._mode = mode
        self._extension = _extension()  # (options belongs to it)
        self.plan = self._extension.forward_plan(*self._call)
        self.kernels = Kernels(*(self.plan[role] for role in FORWARD_ROLES))

    def _new(self, shape, dtype: str) -> torch.Tensor:
        return self._call[0].new_empty(shape, dtype=getattr(torch, dtype))

    def new_ab(self) -> torch.Tensor:
        return self._new(self.plan["ab_shape"], self.plan["ab_dtype"])

    def new_z(self) -> Optional[torch.Tensor]:
        return None if self.plan["z_shape"] is None else self._new(self.plan["z_shape"], self.plan["z_dtype"])

    def new_out(self) -> torch.Tensor:
        return torch.empty_like(self._call[0], memory_format=torch.contiguous_format)

    def new_x_hat(self) -> Optional[torch.Tensor]:
        """A buffer for LayerNorm_in's rows (no affine, bf16 [B*N*N, C]) where the plan's input kernel can write
        them beside ab (plan "x_hat_shape"; else None): a training forward keeps them for the backward."""
        shape = self.plan["x_hat_shape"]
        return None if shape is None else self._new(shape, "bfloat16")

    def new_x_hat_rstd(self) -> Optional[torch.Tensor]:
        """A buffer for LayerNorm_in's rstd per position (fp32 [B*N*N]) beside new_x_hat's rows."""
        shape = self.plan["x_hat_shape"]
        return None if shape is None else self._new(shape[:1], "float32")

    def new_side(self) -> torch.Tensor:
        """A buffer for one side's planes (ab_shape less its first dimension): input_pass's a and b apart."""
        return self._new(self.plan["ab_shape"][1:], self.plan["ab_dtype"])

    def input_pass(self, ab: torch.Tensor, x_hat: Optional[torch.Tensor] = None,
                   x_hat_rstd: Optional[torch.Tensor] = None, b: Optional[torch.Tensor] = None) -> None:
        """The input pass into ab (a_t then b_t), or with b given into ab (a_t alone) and b (new_side's)."""
        self._extension.input_pass(*self._call, ab, x_hat, x_hat_rstd, b)

    def contraction(self, ab: torch.Tensor, z: Optional[torch.Tensor]) -> None:
        with _bmm_precision(self.kernels, self._mode):
            self._extension.contraction(*self._call, ab, z)

    def output_pass(self, out: torch.Tensor, z: Optional[torch.Tensor] = None,
                    ab: Optional[torch.Tensor] = None, gate_rows=None) -> None:
        """gate_rows: (rows, weights, options): bf16 rows [B*N*N, C] the gate reads instead of pair's, with the
        weights and raw-gate options that go with them (_gate_reads_x_hat: x_hat, out_gate folded with
        LayerNorm_in's affine), where the plan says "gate_rows"; out keeps pair's dtype."""
        pair, mask, weights, options = self._call
        rows = None
        if gate_rows is not None:
            rows, weights, options = gate_rows
        self._extension.output_pass(pair, mask, weights, options, ab, z, out, rows)

    def run(self) -> torch.Tensor:
        """The three steps on fresh buffers: what the one-call forward computes."""
        ab, z, out = self.new_ab(), self.new_z(), self.new_out()
        self.input_pass(ab)
        self.contraction(ab, z)
        self.output_pass(out, z=z, ab=ab)
        return out


# ------------------------------------------------------------------------------------------------
# Training: the fused forward as a differentiable op (trimul) and its backward (trimul_backward)
# ------------------------------------------------------------------------------------------------
# The backward takes the forward's inputs (pair_repr, the mask, the parameters) and what the forward kept for
# it (backward_saves, _saves_z: z, the a/b planes, LayerNorm_in's rows), recomputes the rest, then runs the
# backward roles
#   output_backward    LayerNorm_out(z) rows, out_proj, the output gate -> dz planes
#   contract_backward  z = a b^T where not kept, then da = dz b and db = dz^T a per hidden channel
#   input_backward     LayerNorm_in rows, gates, projections, mask -> d pair_repr
#   position_gemm      the GEMMs of rows times a weight and the weight gradients (cuBLAS or scaled fp16 parts)
# LayerNorm affines are folded into the Linear after them
# (W diag(w), b + W b_ln), so every pass handles normalized rows, and each LayerNorm's and Linear's
# gradients come from the folded GEMM's (_unfolded_grads). Weight gradients reduce over positions in a
# fixed order (GEMMs and sums, no atomics): equal inputs give bitwise-equal gradients.

# The backward's operand dtype per mode. fp16 inputs too take bf16: fp16's range cannot hold the backward's
# intermediates (LayerNorm_out of a masked, all-zero z row scales d z by 1/sqrt(eps); its da overflowed fp16).
_COMPUTE_DTYPE = {"bf16": torch.bfloat16, "f16": torch.bfloat16, "high": torch.float32, "highest": torch.float32}


class _Products:
    """The backward's matrix products in a mode: 16-bit operands multiply as they are, with fp32 accumulation;
    fp32 ones at the matmul precision around the backward (TF32 at "high", fp32 at "highest"); fp64 (the CPU)
    in fp64. The GEMMs over positions (a weight times rows: linear, rows_mm) of fp32 rows on CUDA at "highest"
    go to the position_gemm role instead (the extension's position_gemm: its kernel, or cuBLAS for the torch
    baseline), as the C++ backward's do (the same bits)."""

    def __init__(self, gemm: Optional[str] = None):
        self._gemm = gemm  # position_gemm's choice ("": the default order); None: cuBLAS for every product

    def _by_role(self, rows) -> bool:
        return self._gemm is not None and rows.is_cuda and rows.dtype == torch.float32

    @staticmethod
    def mm(x, y, out_dtype):
        if x.dtype in (torch.bfloat16, torch.float16) and out_dtype != x.dtype and x.is_cuda:
            return torch.mm(x, y, out_dtype=out_dtype)
        return torch.mm(x, y).to(out_dtype)

    def rows_mm(self, rows, weight_kn, out_dtype):
        """rows [P, K] @ weight_kn [K, N], a GEMM over positions (K: channels), in out_dtype."""
        if self._by_role(rows):
            return _extension().position_gemm(self._gemm, rows, weight_kn.t(), None, _PRECISION_CODE["highest"])
        return self.mm(rows, weight_kn, out_dtype)

    def rows_grad(self, d_rows, rows, out_dtype):
        """d_rows^T @ rows summed over the positions (a weight gradient), in out_dtype."""
        if self._by_role(rows) and d_rows.dtype == torch.float32:
            return _extension().position_gemm_grad(self._gemm, d_rows, rows, _PRECISION_CODE["highest"])
        return self.mm(d_rows.t(), rows, out_dtype)

    @staticmethod
    def bmm(x, y):
        """x @ y per plane, in x's dtype."""
        return torch.bmm(x, y)

    @staticmethod
    def add_mm_(total, x, y):
        """total += x @ y in total's dtype, in place (16-bit products: the sum in the GEMM's epilogue)."""
        if x.dtype in (torch.bfloat16, torch.float16) and total.dtype != x.dtype and x.is_cuda:
            torch.addmm(total, x, y, out_dtype=total.dtype, out=total)
        else:
            total.addmm_(x.to(total.dtype), y.to(total.dtype))

    def linear(self, rows, weight, bias):
        """rows @ weight^T + bias in the rows' dtype."""
        if self._by_role(rows):
            return _extension().position_gemm(self._gemm, rows, weight, bias, _PRECISION_CODE["highest"])
        return torch.addmm(bias.to(rows.dtype), rows, weight.to(rows.dtype).t())


def _tf32_split(t: torch.Tensor) -> torch.Tensor:
    """fp32 t [batch, ...]: its TF32 parts (the low 13 mantissa bits cleared), then the remainders t - part (exact
    in fp32), [2 * batch, ...]: the split operands of the extension's contract_split (ContractArgs::split)."""
    whole = t.contiguous()
    part = (whole.view(torch.int32) & -8192).view(torch.float32)
    return torch.cat([part, whole - part])


def _folded(weight, bias, ln_weight, ln_bias):
    """A Linear that reads LayerNorm(x) = x_hat * w + b, as one on x_hat: (W diag(w), bias + W b)."""
    return weight * ln_weight, bias + weight @ ln_bias


def _planes(rows: torch.Tensor, batch: int, n: int, incoming: bool) -> torch.Tensor:
    """[B*N*N, H] position rows -> [B*H, N, N] planes, the contraction's operand layout (ForwardArgs::a_t)."""
    return _contraction_layout(rows.view(batch, n, n, -1), "incoming" if incoming else "outgoing")


def _rows(planes: torch.Tensor, batch: int, n: int, incoming: bool) -> torch.Tensor:
    """_planes' inverse: [B*H, N, N] planes -> [B*N*N, H] position rows."""
    order = (0, 3, 2, 1) if incoming else (0, 2, 3, 1)
    return planes.view(batch, -1, n, n).permute(order).reshape(batch * n * n, -1)


def _normalized_rows(rows: torch.Tensor, eps: float):
    """LayerNorm without affine in fp32 (fp64 rows: fp64): (x_hat, rstd [P, 1])."""
    acc = rows.to(torch.float64 if rows.dtype == torch.float64 else torch.float32)
    centered = acc - acc.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centered.square().mean(-1, keepdim=True) + eps)
    return centered * rstd, rstd


def _layer_norm_backward(x_hat, rstd, d_x_hat):
    """d x of x_hat = LayerNorm(x) (no affine) from d x_hat."""
    return rstd * (d_x_hat - d_x_hat.mean(-1, keepdim=True) - x_hat * (d_x_hat * x_hat).mean(-1, keepdim=True))


class _TorchBackwardPasses:
    """The backward's memory passes in PyTorch ops: the baseline (the backward roles' "torch" kernels)."""

    @staticmethod
    def input_rows(pair_rows, eps, dtype):
        """LayerNorm_in's normalized rows (x_hat, [P, C]) in the operand dtype."""
        return _normalized_rows(pair_rows, eps)[0].to(dtype)

    @staticmethod
    def gated_planes(proj, mask_rows, batch, n, incoming):
        """a and b = proj * sigmoid(gate) * mask from proj [P, 4H] (pa | ga | pb | gb), as planes."""
        pa, ga, pb, gb = proj.to(_accumulate(proj)).chunk(4, 1)
        m = mask_rows.to(pa.dtype)[:, None]
        a, b = pa * torch.sigmoid(ga) * m, pb * torch.sigmoid(gb) * m
        return _planes(a.to(proj.dtype), batch, n, incoming), _planes(b.to(proj.dtype), batch, n, incoming)

    @staticmethod
    def z_rows(z_planes, batch, n, eps, dtype):
        """LayerNorm_out's normalized rows of z (z_hat, [P, H]) and their rstd [P, 1]."""
        z_hat, rstd = _normalized_rows(_rows(z_planes, batch, n, False), eps)
        return z_hat.to(dtype), rstd

    @staticmethod
    def gate_grad(d_out, o, gate_pre, gate_out=None):
        """out = sigmoid(gate_pre) * o: (d o, d gate_pre) in o's dtype, and their sums over positions. gate_out:
        rows (of a wider buffer) that receive d gate_pre, returned as it."""
        dtype, acc = o.dtype, _accumulate(o)
        d_out, o, g = d_out.to(acc), o.to(acc), torch.sigmoid(gate_pre.to(acc))
        d_o, d_gate = d_out * g, d_out * o * g * (1 - g)
        d_gate_rows = d_gate.to(dtype) if gate_out is None else gate_out.copy_(d_gate)
        return d_o.to(dtype), d_gate_rows, d_o.sum(0), d_gate.sum(0)

    @staticmethod
    def dz_planes(d_z_hat, z_hat, rstd, batch, n, dtype):
        """dz planes from LayerNorm_out's backward on rows."""
        dz = _layer_norm_backward(z_hat.to(d_z_hat.dtype), rstd, d_z_hat)
        return _planes(dz.to(dtype), batch, n, False)

    @staticmethod
    def dz_planes_from_d_o():
        """Whether dz_planes multiplies d z_hat itself (_KernelBackwardPasses.dz_planes_multiplied): never here."""
        return False

    @staticmethod
    def gate_grad_from_z():
        """Whether one pass runs z_rows, the o / gate_pre products and gate_grad (_KernelBackwardPasses.z_gate_grad):
        never here."""
        return False

    @staticmethod
    def g_out_in_dz_planes():
        """Whether dz_planes multiplies g_out = d o^T z_hat too (_KernelBackwardPasses.dz_planes_g_out): never
        here."""
        return False

    @staticmethod
    def d_proj_from_x_hat():
        """Whether d_proj recomputes proj from x_hat itself (_KernelBackwardPasses.d_proj_recomputed): never here."""
        return False

    @staticmethod
    def d_proj(proj, da_planes, db_planes, mask_rows, batch, n, incoming, mask_grad, in_place=False, out=None):
        """d proj [P, 4H] (pa | ga | pb | gb) from da and db planes; d mask [P] where mask_grad; d proj's sums
        over positions. (in_place: allowed, not done: the baseline's d proj is a new tensor.) out: rows (of a
        wider buffer) that receive d proj, returned as it."""
        acc = _accumulate(proj)
        pa, ga, pb, gb = proj.to(acc).chunk(4, 1)
        m = mask_rows.to(acc)[:, None]
        da, db = (_rows(t, batch, n, incoming).to(acc) for t in (da_planes, db_planes))
        sa, sb = torch.sigmoid(ga), torch.sigmoid(gb)
        d_proj = torch.cat([da * sa * m, da * pa * m * sa * (1 - sa), db * sb * m, db * pb * m * sb * (1 - sb)], 1)
        d_mask = (da * pa * sa + db * pb * sb).sum(1) if mask_grad else None
        return d_proj.to(proj.dtype) if out is None else out.copy_(d_proj), d_mask, d_proj.sum(0)

    @staticmethod
    def d_pair_from_d_proj():
        """Whether d_pair multiplies d x_hat itself (_KernelBackwardPasses.d_pair_multiplied): never here."""
        return False

    @staticmethod
    def d_pair_in_d_proj():
        """Whether d_proj writes d pair too (_KernelBackwardPasses.d_proj_d_pair): never here."""
        return False

    @staticmethod
    def d_pair(pair_rows, eps, d_x_hat, add=None):
        """d pair_repr rows from LayerNorm_in's backward (statistics recomputed from pair_repr), plus `add`."""
        x_hat, rstd = _normalized_rows(pair_rows, eps)
        d_pair = _layer_norm_backward(x_hat, rstd, d_x_hat)
        return d_pair if add is None else d_pair + add


def _summed(sums: torch.Tensor) -> torch.Tensor:
    """A pass's sums over positions: as returned (a torch pass's), or its per-block partials [_BACKWARD_SUM_ROWS,
    width] summed (a kernel pass's, which param_grads sums itself in a fixed order)."""
    return sums.sum(0) if sums.dim() == 2 else sums


def _accumulate(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


_BACKWARD_SUM_ROWS = 512  # blocks of the passes that sum over positions (trimul::kBackwardSumRows)
_BACKWARD_PASS = {name: code for code, name in enumerate(
    ("input_rows", "gated_planes", "z_rows", "gate_grad", "dz_planes", "d_proj", "d_pair", "split_f16x3",
     "z_gate_grad", "d_proj_d_pair", "dz_planes_g_out"))}  # trimul::BackwardPass


class _KernelBackwardPasses:
    """The backward's memory passes on a backward role's kernel of ours (kernels/*_backward_*.cu), with
    _TorchBackwardPasses' signatures, but for sums over positions: returned as the pass's per-block partials
    [_BACKWARD_SUM_ROWS, width] (_summed adds them), which param_grads sums in a fixed order."""

    def __init__(self, role, kernel, batch, n, pair_dim, hidden, incoming, precision, like):
        self._call = (role, kernel)
        self._sizes = (batch, n, pair_dim, hidden, incoming, precision)
        self._positions, self._hidden = batch * n * n, hidden
        self._like = like  # (an empty tensor of the operand dtype on the device)

    def _run(self, name, eps=0.0, **tensors):
        """Pass `name` on the tensors; its operand dtype and device are the backward's (self._like) for every
        pass, as the C++ backward names them (a kernel's rules read the operand dtype)."""
        _extension().backward_pass(*self._call, _BACKWARD_PASS[name], *self._sizes, eps, self._like, tensors)

    def _planes(self, count=1):
        shape = (count, self._sizes[0] * self._hidden, self._sizes[1], self._sizes[1])  # (B*H, N, N)
        return self._like.new_empty(shape).unbind(0) if count > 1 else self._like.new_empty(shape[1:])

    def input_rows(self, pair_rows, eps, dtype):
        rows = pair_rows.new_empty(pair_rows.shape, dtype=dtype)
        self._run("input_rows", eps, pair=pair_rows, rows=rows)
        return rows

    def gated_planes(self, proj, mask_rows, batch, n, incoming):
        a_planes, b_planes = self._planes(2)
        self._run("gated_planes", proj=proj, mask=mask_rows, a_planes=a_planes, b_planes=b_planes)
        return a_planes, b_planes

    def z_rows(self, z_planes, batch, n, eps, dtype):
        rows = z_planes.new_empty((self._positions, self._hidden))
        rstd = z_planes.new_empty((self._positions, 1), dtype=torch.float32)
        self._run("z_rows", eps, a_planes=z_planes, rows=rows, rstd=rstd)
        return rows, rstd

    def gate_grad(self, d_out, o, gate_pre, gate_out=None):
        sums = o.new_zeros((_BACKWARD_SUM_ROWS, 2 * o.shape[1]), dtype=torch.float32)
        outputs = {} if gate_out is None else {"gate_out": gate_out}
        self._run("gate_grad", d_out=d_out, o=o, gate_pre=gate_pre, sums=sums, **outputs)
        return (o, gate_pre if gate_out is None else gate_out) + sums.chunk(2, dim=1)

    def dz_planes(self, d_z_hat, z_hat, rstd, batch, n, dtype):
        dz = self._planes()
        self._run("dz_planes", d_rows=d_z_hat, rows=z_hat, rstd=rstd, a_planes=dz)
        return dz

    def _takes(self, role, probe):
        """Whether this is `role`'s kernel and the extension's `probe` (its C++ function of that name) says it
        takes the pass with its inputs left to the pass, at these sizes."""
        return self._call[0] == role and getattr(_extension(), probe)(self._call[1], *self._sizes[:5], self._like,
                                                                      self._sizes[5])

    def dz_planes_from_d_o(self):
        """Whether this kernel's dz_planes multiplies d z_hat itself (dz_planes_multiplied) at these sizes."""
        return self._takes("output_backward", "dz_planes_from_d_o")

    def gate_grad_from_z(self):
        """Whether this kernel runs z_rows, the o / gate_pre products and gate_grad as one pass (z_gate_grad)."""
        return self._takes("output_backward", "gate_grad_from_z")

    def g_out_in_dz_planes(self):
        """Whether this kernel's dz_planes multiplies g_out = d o^T z_hat too (dz_planes_g_out) at these sizes."""
        return self._takes("output_backward", "dz_planes_g_out")

    def dz_planes_g_out(self, d_o, w_out_f, z_hat, rstd):
        """dz_planes_multiplied, and g_out = d o^T z_hat from the pass's per-block partials, summed in a fixed order
        (as training_backward in bindings.cpp sums them): (dz planes, g_out fp32 [C, H])."""
        rows = _extension().g_out_partial_rows(self._like)
        partials = d_o.new_empty((rows, d_o.shape[1], self._hidden), dtype=torch.float32)
        dz = self.dz_planes_multiplied(d_o, w_out_f, z_hat, rstd, "dz_planes_g_out", g_out=partials)
        return dz, partials.sum(0)

    def z_gate_grad(self, z_planes, eps, gate_rows, w_out_f, b_out_f, w_gate, b_gate, d_out):
        """z_rows, o = z_hat w_out_f^T + b_out_f, gate_pre = gate_rows w_gate^T + b_gate and gate_grad in one pass (o
        and gate_pre never written): (z_hat, rstd, d o, d gate_pre, their partial sums over positions)."""
        z_hat = z_planes.new_empty((self._positions, self._hidden))
        rstd = z_planes.new_empty((self._positions, 1), dtype=torch.float32)
        d_o, d_gate = gate_rows.new_empty(d_out.shape), gate_rows.new_empty(d_out.shape)
        sums = d_out.new_zeros((_BACKWARD_SUM_ROWS, 2 * d_out.shape[1]), dtype=torch.float32)
        weights = {name: t.float().contiguous() for name, t in
                   (("w_out_f", w_out_f), ("b_out_f", b_out_f), ("w_gate_f", w_gate), ("b_gate_f", b_gate))}
        self._run("z_gate_grad", eps, a_planes=z_planes, x_hat=gate_rows, d_out=d_out, o=d_o, gate_pre=d_gate,
                  rows=z_hat, rstd=rstd, sums=sums, **weights)
        return (z_hat, rstd, d_o, d_gate) + sums.chunk(2, dim=1)

    def dz_planes_multiplied(self, d_o, w_out_f, z_hat, rstd, name="dz_planes", **outputs):
        """dz_planes with d z_hat = d_o w_out_f multiplied in the pass (never written): as dz_planes. (name, outputs:
        the pass that writes more, dz_planes_g_out's partials.)"""
        dz = self._planes()
        self._run(name, d_o=d_o, w_out_f=w_out_f.float().contiguous(), rows=z_hat, rstd=rstd, a_planes=dz, **outputs)
        return dz

    def _d_proj_pass(self, rows, mask_grad, name="d_proj", eps=0.0, **inputs):
        """The d_proj pass (or `name`) into `rows` (d proj [P, 4H]) from `inputs` (proj, or x_hat and the folded
        weights; the da/db planes and the mask): (d proj, d mask or None, d proj's partial sums over
        positions)."""
        sums = rows.new_zeros((_BACKWARD_SUM_ROWS, 4 * self._hidden), dtype=torch.float32)
        d_mask = rows.new_empty((self._positions,), dtype=torch.float32) if mask_grad else None
        if d_mask is not None:
            inputs["d_mask"] = d_mask
        self._run(name, eps, rows=rows, sums=sums, **inputs)
        return rows, d_mask, sums

    def d_proj(self, proj, da_planes, db_planes, mask_rows, batch, n, incoming, mask_grad, in_place=False, out=None):
        rows = out if out is not None else proj if in_place else torch.empty_like(proj)
        return self._d_proj_pass(rows, mask_grad, proj=proj, a_planes=da_planes, b_planes=db_planes, mask=mask_rows)

    def d_proj_from_x_hat(self):
        """Whether this kernel's d_proj recomputes proj from x_hat (d_proj_recomputed) at these sizes."""
        return self._takes("input_backward", "d_proj_from_x_hat")

    def d_proj_recomputed(self, x_hat, w_in_f, b_in_f, da_planes, db_planes, mask_rows, mask_grad):
        """d_proj with proj = x_hat w_in_f^T + b_in_f recomputed in the pass (never written): as d_proj."""
        return self._d_proj_pass(x_hat.new_empty((self._positions, 4 * self._hidden)), mask_grad, x_hat=x_hat,
                                 w_in_f=w_in_f.float().contiguous(), b_in_f=b_in_f.float().contiguous(),
                                 a_planes=da_planes, b_planes=db_planes, mask=mask_rows)

    def d_pair_in_d_proj(self):
        """Whether this kernel's d_proj writes d pair too (d_proj_d_pair) at these sizes."""
        return self._takes("input_backward", "d_pair_in_d_proj")

    def d_proj_d_pair(self, x_hat, rstd, eps, w_in_f, b_in_f, da_planes, db_planes, mask_rows, mask_grad, d_gate,
                      w_gate_f, pair_rows):
        """d_proj_recomputed that also writes d pair: d x_hat = d proj w_in_f + d_gate w_gate_f and LayerNorm_in's
        backward on x_hat with its rstd (the forward's), in the pass; pair's rows are not read (only their dtype):
        (d proj, d mask or None, d proj's sums, d pair rows)."""
        d_pair = torch.empty_like(pair_rows)
        return self._d_proj_pass(x_hat.new_empty((self._positions, 4 * self._hidden)), mask_grad, "d_proj_d_pair",
                                 eps, x_hat=x_hat, rstd=rstd, w_in_f=w_in_f.float().contiguous(),
                                 b_in_f=b_in_f.float().contiguous(), a_planes=da_planes, b_planes=db_planes,
                                 mask=mask_rows, d_gate=d_gate, w_gate_f=w_gate_f.float().contiguous(),
                                 d_pair=d_pair) + (d_pair,)

    def _d_pair_pass(self, pair_rows, eps, add, **inputs):
        """The d_pair pass from `inputs` (d x_hat, or d proj and d gate with the folded weights), plus `add`."""
        out = torch.empty_like(pair_rows)  # (pair's dtype: the pass rounds a 16-bit gradient once)
        if add is not None:
            inputs["d_rows_add"] = add
        self._run("d_pair", eps, pair=pair_rows, d_pair=out, **inputs)
        return out

    def d_pair(self, pair_rows, eps, d_x_hat, add=None):
        return self._d_pair_pass(pair_rows, eps, add, d_rows=d_x_hat)

    def d_pair_from_d_proj(self):
        """Whether this kernel's d_pair multiplies d x_hat itself (d_pair_multiplied) at these sizes."""
        return self._takes("input_backward", "d_pair_from_d_proj")

    def d_pair_multiplied(self, pair_rows, eps, d_proj, w_in_f, d_gate=None, w_gate_f=None, add=None):
        """d_pair with d x_hat = d_proj w_in_f (+ d_gate w_gate_f) multiplied in the pass (never written): as d_pair
        on that d x_hat."""
        inputs = dict(rows=d_proj, w_in_f=w_in_f.float().contiguous())
        if d_gate is not None:
            inputs.update(d_gate=d_gate, w_gate_f=w_gate_f.float().contiguous())
        return self._d_pair_pass(pair_rows, eps, add, **inputs)


def _precision_code(mode: str) -> int:
    """The extension's code (trimul::Precision) of the matmul precision a compute mode stands for."""
    return _PRECISION_CODE[_MODE_PRECISION.get(mode, "highest")]


def _backward_kernel(role: str, name: Optional[str], batch, n, pair_dim, hidden, incoming, operand, mode,
                     block_rows: int = 0) -> str:
    """The library kernel a backward role runs for the call (name, else the default order's first that takes it);
    "" for a torch baseline (and off CUDA). block_rows: a block of pair's rows (a sharded rank's; 0: N)."""
    if not operand.is_cuda or _is_torch_kernel(role, name):
        return ""
    return _extension().backward_kernel(role, name or "", batch, n, pair_dim, hidden, incoming, operand,
                                        _precision_code(mode), block_rows)


def _backward_passes(role: str, name: Optional[str], batch, n, pair_dim, hidden, incoming, operand, mode):
    """The memory passes of a backward role's kernel (None: the default order's first that takes the call):
    _KernelBackwardPasses, or _TorchBackwardPasses for a torch baseline (and off CUDA)."""
    kernel = _backward_kernel(role, name, batch, n, pair_dim, hidden, incoming, operand, mode)
    return _KernelBackwardPasses(role, kernel, batch, n, pair_dim, hidden, incoming, _precision_code(mode), operand) \
        if kernel else _TorchBackwardPasses


class _BmmContractions:
    """contract_backward's torch baseline: the N^3 products per plane by torch.bmm (cuBLAS), at the matmul
    precision around the backward."""

    def __init__(self, products):
        self._products = products

    def z(self, a_planes, b_planes):
        return self._products.bmm(a_planes, b_planes.transpose(1, 2))

    def grads(self, a_planes, b_planes, dz_planes):
        """(da = dz b, db = dz^T a)."""
        return self._products.bmm(dz_planes, b_planes), self._products.bmm(dz_planes.transpose(1, 2), a_planes)


class _KernelContractions:
    """contract_backward on a library kernel (wgmma_f16x3): the same products from split operands, in the
    extension's contract_backward_products (the C++ backward calls it too: both paths give the same bits)."""

    def __init__(self, kernel):
        self._kernel = kernel

    def z(self, a_planes, b_planes):
        return _extension().contract_backward_products(self._kernel, a_planes, b_planes, None)[0]

    def grads(self, a_planes, b_planes, dz_planes):
        return tuple(_extension().contract_backward_products(self._kernel, a_planes, b_planes, dz_planes))


def _unfolded_grads(g_folded, s_folded, weight, ln_weight, ln_bias):
    """A folded Linear's gradients (g = d(W diag(w))-GEMM's d_out^T x_hat, s = sum of d_out) as the Linear's
    weight and bias gradients and its LayerNorm's share: (d W, d bias, d ln_weight, d ln_bias)."""
    return (g_folded * ln_weight + torch.outer(s_folded, ln_bias), s_folded, (weight * g_folded).sum(0),
            s_folded @ weight)


def _check_position_gemm_choice(name: Optional[str], mode: str, pair: torch.Tensor) -> None:
    """A position_gemm kernel chosen by name takes the fp32 GEMMs of a CUDA backward at "highest" only (elsewhere
    the backward's GEMMs are cuBLAS's in the mode's operand dtype): named for any other call, a ValueError saying
    so, as a chosen kernel of another role that does not take its call raises, instead of a choice silently
    ignored."""
    if name is None or _is_torch_kernel("position_gemm", name) or \
            (mode == "highest" and pair.is_cuda and pair.dtype != torch.float64):
        return
    applies = next((e.applies for e in kernel_registry() if e.role == "position_gemm" and e.name == name), "")
    raise ValueError(f"trimul_inline: the position_gemm kernel {name!r} does not take this call (a {mode!r} backward "
                     f"on {pair.device.type}); it applies when: {applies}")


def training_backward(grad_out, pair, mask, params, kernels: "Kernels", mode: str, incoming: bool,
                      gate_normalized: bool, eps_in: float, eps_out: float, mask_grad: bool, host: str = "auto",
                      saved_z: Optional[torch.Tensor] = None, lean: bool = False,
                      saved_ab: Optional[torch.Tensor] = None, saved: Optional[list] = None,
                      saved_x_hat: Optional[torch.Tensor] = None, saved_x_hat_rstd: Optional[torch.Tensor] = None,
                      pair_grad: bool = True, params_grad: bool = True, graph_capture: bool = True):
    """The gradients of sum(grad_out * forward(pair, mask)): [d pair, d mask (None unless mask_grad), then the 16
    parameters' (_PARAM_PATHS order)], each in its tensor's dtype; d pair None unless pair_grad, the parameters'
    None unless params_grad (their work skipped: a frozen layer, a first layer). Any device; CUDA in the op. host: "auto" runs
    a CUDA call whose backward roles are library kernels in one extension call (the same steps in C++: the
    host time of a small step), replayed from a CUDA graph (_graphed_backward) for problems of at most
    GRAPHED_BACKWARD_POSITIONS positions and GRAPHED_BACKWARD_BYTES of pair-sized operands (_graphs_backward);
    "call" always the one extension call; "graph" a graph at any size; "python" always here step by step. A
    16-bit mode's small CUDA call multiplies in TF32 (_backward_mode). saved_z: the forward's z planes
    [B*H, N, >= N] in the backward's operand dtype, used instead of recomputing z; lean: proj recomputed before
    d_proj instead of kept across the output side (a [P, 4H] buffer off the peak, one GEMM more; DESIGN.md
    "Training"); saved_ab (with saved_z): the forward's a/b planes [2, B*H, N, >= N] in the operand dtype, read
    in place instead of gated_planes (and, lean, the first proj GEMM). saved_x_hat: the forward's LayerNorm_in
    rows [B*N*N, C] in the operand dtype (ForwardSteps.new_x_hat), used instead of the input_rows pass;
    saved_x_hat_rstd (with it): their rstd, fp32 [B*N*N] (ForwardSteps.new_x_hat_rstd), with which d_proj can
    write d pair too (d_proj_d_pair). saved: the four as a list [saved_z, saved_ab, saved_x_hat, saved_x_hat_rstd]
    instead, which the call empties so that each is freed once used (the caller keeps no reference:
    _TrimulFunction's way). graph_capture: False replays a small call's graph only where one was captured before,
    never capturing one (the op where inductor puts the compiled step in CUDA graphs, _traced_for_cuda_graphs: its
    warm-up sends every allocation of the thread to its own pool, where a graph's held inputs and outputs would stay
    as tensors it does not track; and opcheck's calls)."""
    if saved is None:
        saved = [saved_z, saved_ab, saved_x_hat, saved_x_hat_rstd]
    if len(saved) != 4:
        raise ValueError("trimul_inline: training_backward's saved list is [z or None, a/b or None, x_hat or None, "
                         "x_hat's rstd or None]")
    del saved_z, saved_ab, saved_x_hat, saved_x_hat_rstd
    mode = _backward_mode(mode, pair)
    _check_position_gemm_choice(kernels.position_gemm, mode, pair)
    with _float32_matmul_precision(_MODE_PRECISION.get(mode, "highest")):
        if pair.is_cuda and pair.dtype != torch.float64 and host != "python":
            graphed = all(t is None for t in saved) and not lean and \
                (host == "graph" or (host == "auto" and _graphs_backward(pair, mode)))
            call = (grad_out, pair, mask, params, kernels.output_backward or "", kernels.input_backward or "",
                    kernels.contract_backward or "", kernels.position_gemm or "", _precision_code(mode),
                    _COMPUTE_DTYPE[mode] == torch.float32, incoming, gate_normalized, eps_in, eps_out, mask_grad,
                    pair_grad, params_grad, None if graphed else saved, lean)
            grads = _graphed_backward(call, graph_capture) if graphed else None
            if grads is None:
                grads = _extension().training_backward(*call)
            if grads:  # (empty: a backward role runs a torch baseline, which the Python path below runs)
                return grads
        grads = _training_backward(grad_out, pair, mask, [p.detach() for p in params], kernels, mode, incoming,
                                   gate_normalized, eps_in, eps_out, mask_grad, saved, lean, pair_grad, params_grad)
    d_pair, d_mask, d_params = grads
    return _distinct([None if d_pair is None else d_pair.view(pair.shape).to(pair.dtype),
                      None if d_mask is None else d_mask.view(mask.shape).to(mask.dtype)] +
                     [None if g is None else g.to(p.dtype) for g, p in zip(d_params, params)])


# What the training forward keeps for its backward (ModelNew's backward_saves): "inputs" (pair_repr, the mask,
# the parameters: the backward recomputes a/b and z) or "z" as well (the forward's z planes, B*H*N^2 operands,
# and in the 16-bit modes its a/b planes, kept from the forward to the backward: one N^3 product and the a/b
# recompute fewer). None: "z" on CUDA past the graphed sizes (_graphs_backward: a graphed backward takes no saved
# tensor, and its step is host time anyway): the buffers are the ones the backward would allocate for its
# recompute, handed over and freed after their last use, so the step's peak stays the backward's own (the
# d_proj pass), while the z product (at "highest" an fp32 one on the CUDA cores), gated_planes and, lean, a proj
# GEMM are saved. The backward runs lean (proj recomputed, _runs_lean) where z is
# kept for memory: from LEAN_BACKWARD_POSITIONS, or when the caller chose "z".
BACKWARD_SAVES = ("inputs", "z")
LEAN_BACKWARD_POSITIONS = 1 << 22


@torch._dynamo.assume_constant_result
def _traced_for_cuda_graphs() -> bool:
    """At torch.compile's trace time (dynamo runs this once and keeps the answer): whether the compile may put the
    graph in CUDA graphs: inductor's options (mode="reduce-overhead" and "max-autotune" set triton.cudagraphs) or
    its global config; True for another backend or where it cannot tell. A traced training forward keeps nothing
    then: its kept buffers have sizes known only at run time, and inductor's CUDA-graph partitions hand such outputs
    of a custom op on as tensors outside the graphs' pool, which its cudagraph trees refuse."""
    backend = getattr(_trace_under_way(), "compiler_fn", None)
    if backend is None:
        return True
    for _ in range(8):  # (the backend as dynamo wraps it: the inductor wrapper's options dict, else unwrap)
        options = getattr(backend, "config", None)
        if isinstance(options, dict):
            import torch._inductor.config as inductor_config
            return bool(options.get("triton.cudagraphs", inductor_config.triton.cudagraphs))
        backend = getattr(backend, "__wrapped__", None) or getattr(backend, "compiler_fn", None)
        if backend is None:
            break
    return True


@torch._dynamo.assume_constant_result
def _traces_run_time_sizes() -> bool:
    """At torch.compile's trace time: whether dynamo traces an op whose outputs' sizes are known only at run time
    (its shape environment allows dynamic output shapes: fullgraph=True, or capture_dynamic_output_shape_ops);
    elsewhere such an op is a graph break. True where it cannot tell."""
    shape_env = getattr(_trace_under_way(), "shape_env", None)
    return True if shape_env is None else bool(shape_env.allow_dynamic_output_shape_ops)


def _trace_under_way():
    """dynamo's output graph of the trace under way (the functions above run at trace time), or None where it
    cannot be read."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        return InstructionTranslator.current_tx().output
    except (ImportError, AttributeError):
        return None


@torch._dynamo.disable
def _trained_eagerly(layers, pair_repr, pair_mask, mode, kernels):
    """layers' training forward outside torch.compile's graph (a graph break there): the eager step's."""
    return layers._forward_trained(pair_repr, pair_mask, mode, kernels)


def _saves_z(choice: Optional[str], graphed: bool, cuda: bool, hooked: bool = False) -> bool:
    """Whether the eager training forward keeps z (the backward_saves rule above); graphed: its backward would replay
    a graph (_graphs_backward). hooked: saved-tensor hooks other than torch.utils.checkpoint's are active
    (save_on_cpu, a user's): the kept buffers (several times the pair's bytes) would be theirs to move, so nothing
    is kept and the backward recomputes. Under a non-reentrant checkpoint the buffers are saved tensors
    (_TrimulFunction): its first forward keeps a placeholder for each, its recompute in the backward hands them to
    the first forward's node, whose backward then skips their recompute; a reentrant checkpoint's recompute runs
    with no hooks and its backward uses what it keeps."""
    if hooked:
        return False
    if choice is not None:
        return choice == "z"
    return cuda and not graphed


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks) are in effect now."""
    return _top_saved_tensor_hooks() is not None


def _checkpoint_hooks_active() -> bool:
    """Whether the saved-tensor hooks in effect are torch.utils.checkpoint's own (non-reentrant: its first
    forward's and its recompute's, the same answer for both, so both save the same tensors)."""
    hooks = _top_saved_tensor_hooks()
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


def _top_saved_tensor_hooks():
    """(pack, unpack) of the innermost saved-tensor hooks in effect, or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


def _runs_lean(choice: Optional[str], positions: int) -> bool:
    """Whether a backward given the forward's z runs lean (the backward_saves rule above)."""
    return choice == "z" or positions >= LEAN_BACKWARD_POSITIONS


# A 16-bit mode's CUDA backward calls of at most this many positions take fp32 operands and TF32 products (mode
# "high"): their time is host time either way, and bf16 operands' error over few positions is heavy-tailed
# (LayerNorm_out's backward cancels most of d z_hat over a few channels; bench/NOTES.md). Tests set it to 0 to
# run the bf16 backward at small shapes.
TF32_BACKWARD_POSITIONS = 1 << 14


def _backward_dtype(mode: str, pair: torch.Tensor) -> torch.dtype:
    """The backward's operand dtype for the forward's mode (_backward_mode's, as _COMPUTE_DTYPE maps it)."""
    return _COMPUTE_DTYPE[_backward_mode(mode, pair)]


def _backward_mode(mode: str, pair: torch.Tensor) -> str:
    """The mode the backward computes in: "high" for a 16-bit mode's CUDA call of at most TF32_BACKWARD_POSITIONS
    positions, else the forward's."""
    small = pair.shape[0] * pair.shape[1] * pair.shape[2] <= TF32_BACKWARD_POSITIONS
    return "high" if pair.is_cuda and small and mode in ("bf16", "f16") else mode


# Backward calls of at most this many positions, and of at most this many bytes of pair-sized operands
# (B*N^2*C in the backward's operand dtype), replay a CUDA graph: their time is mostly the host's (~50 ATen calls
# in the one-call backward). The graph's memory pool keeps one backward's intermediates between calls, shared by
# every layer of that shape (bench.py --backward reports it as held memory; sizes in bench/NOTES.md); past these
# sizes the CUDA time dominates, and the copies of pair and grad_out into the graph's inputs and of d pair out
# cost more than the host time saved. fp32 operands ("high", "highest") take twice the CUDA time per position and
# hold twice the pool, so they stop graphing at half the channels.
GRAPHED_BACKWARD_POSITIONS = 1 << 17
GRAPHED_BACKWARD_BYTES = 1 << 25


def _graphs_backward(pair: torch.Tensor, mode: str) -> bool:
    """Whether an "auto" CUDA backward of this pair, its forward in `mode`, replays a graph."""
    positions = pair.shape[0] * pair.shape[1] * pair.shape[2]
    operand_bytes = _backward_dtype(mode, pair).itemsize
    return positions <= GRAPHED_BACKWARD_POSITIONS and positions * pair.shape[3] * operand_bytes <= \
        GRAPHED_BACKWARD_BYTES


# The one-call backward of small problems (training_backward's host "auto"): its ~50 ATen calls are most of such a
# step's time. Keyed by the call's signature (shapes, dtypes, options, the parameters' shapes, dtypes and device, the
# matmul precision, the extension).
_BACKWARD_GRAPHS = _GraphedCalls("the backward", "the backward runs as one extension call")


def _graphed_backward(call, capture: bool = True):
    """training_backward's one extension call replayed from _BACKWARD_GRAPHS (_GraphedCalls.run's answers; capture
    as there)."""
    grad_out, pair, mask, params, *options = call
    extension = _extension()
    key = (tuple((t.shape, t.dtype) for t in (grad_out, pair, mask)), pair.device,
           tuple((p.shape, p.dtype, p.device) for p in params), tuple(options),
           torch.get_float32_matmul_precision(), id(extension))
    return _BACKWARD_GRAPHS.run(key, [grad_out, pair, mask, *params], lambda inputs: extension.training_backward(
        inputs[0], inputs[1], inputs[2], inputs[3:], *options), capture=capture)


def _python_dispatch_mode_active() -> bool:
    """Whether a Python dispatch mode (a profiler's or a user's, around an eager call) sees each ATen call: it
    should see the backward's calls, not a graph replay. (Inside a custom op's implementation the mode is off: the
    op trimul_backward, which opcheck and torch.compile call, captures a graph only where its graph_capture says.)"""
    return _get_current_dispatch_mode() is not None


def _saved_ab_planes(saved_ab, saved_z, batch, n, hidden, dtype):
    """The forward's a/b planes [2, B*H, N, >= N] as two [B*H, N, N] views (rows strided), checked as the C++ steps
    check them."""
    if saved_z is None or saved_ab.dim() != 4 or tuple(saved_ab.shape[:3]) != (2, batch * hidden, n) or \
            saved_ab.shape[3] < n or saved_ab.stride(3) != 1 or saved_ab.dtype != dtype:
        raise ValueError("trimul_inline: training_backward's saved a/b must be [2, B*H, N, >= N] in the operand "
                         "dtype, with a saved z")
    return saved_ab[0, :, :, :n], saved_ab[1, :, :, :n]


def _saved_z_planes(saved_z, batch, n, hidden, dtype):
    """The forward's z (planes [B*H, N, ldz], ldz >= N) as [B*H, N, N] planes in the backward's operand dtype."""
    if saved_z.dim() != 3 or saved_z.shape[0] != batch * hidden or saved_z.shape[1] != n or saved_z.shape[2] < n \
            or saved_z.dtype != dtype:
        raise ValueError(f"trimul_inline: the saved z must be [B*H, N, >= N] = [{batch * hidden}, {n}, >= {n}] in "
                         f"{dtype}, got {tuple(saved_z.shape)} {saved_z.dtype}")
    return saved_z[:, :, :n].contiguous()


def _saved_x_hat_rstd(saved_rstd, saved_x_hat, positions):
    if saved_x_hat is None or saved_rstd.shape != (positions,) or not saved_rstd.is_contiguous() or \
            saved_rstd.dtype != torch.float32:
        raise ValueError(f"trimul_inline: the saved x_hat rstd must be contiguous fp32 [B*N*N] = [{positions}], with "
                         f"a saved x_hat, got {tuple(saved_rstd.shape)} {saved_rstd.dtype}")
    return saved_rstd


def _saved_x_hat_rows(saved_x_hat, positions, pair_dim, dtype):
    if saved_x_hat.shape != (positions, pair_dim) or not saved_x_hat.is_contiguous() or saved_x_hat.dtype != dtype:
        raise ValueError(f"trimul_inline: the saved x_hat must be contiguous [B*N*N, C] = [{positions}, {pair_dim}] "
                         f"in {dtype}, got {tuple(saved_x_hat.shape)} {saved_x_hat.dtype}")
    return saved_x_hat


def _distinct(tensors: list) -> list:
    """The tensors with any that shares memory with an earlier one copied: an op's outputs may not alias each
    other (several bias gradients are slices of one sum)."""
    seen, out = set(), []
    for t in tensors:
        if t is not None:
            key = t.untyped_storage().data_ptr()
            t = t.clone() if key in seen else t
            seen.add(key)
        out.append(t)
    return out


def _training_backward(grad_out, pair, mask, params, kernels, mode, incoming, gate_normalized, eps_in, eps_out,
                       mask_grad, saved, lean=False, pair_grad=True, params_grad=True):
    saved_z, saved_ab, saved_x_hat, saved_rstd = saved
    saved.clear()  # (the caller's list held the only other references: each is freed once used)
    acc = _accumulate(pair)
    # (on CUDA the extension's param_fold: the parameters in fp32 and folded as the one-call backward has them)
    on_device = pair.is_cuda and acc == torch.float32
    if on_device:
        *params_acc, w_in_f, b_in_f, w_out_f, b_out_f, w_gate, b_gate = \
            _extension().param_fold(list(params), gate_normalized)
    else:
        params_acc = [p.to(acc) for p in params]
    (ln_in_w, ln_in_b, pa_w, pa_b, ga_w, ga_b, pb_w, pb_b, gb_w, gb_b, ln_out_w, ln_out_b,
     out_w, out_b, gate_w, gate_b) = params_acc
    batch, n, _, pair_dim = pair.shape
    dtype = acc if acc == torch.float64 else _COMPUTE_DTYPE[mode]
    hidden = pa_w.shape[0]
    operand = pair.new_empty((0,), dtype=dtype)
    inputs = _backward_passes("input_backward", kernels.input_backward, batch, n, pair_dim, hidden, incoming, operand,
                              mode)
    outputs = _backward_passes("output_backward", kernels.output_backward, batch, n, pair_dim, hidden, incoming,
                               operand, mode)
    contract = _backward_kernel("contract_backward", kernels.contract_backward, batch, n, pair_dim, hidden, incoming,
                                operand, mode)
    positions = batch * n * n
    pair_rows, mask_rows = pair.reshape(positions, pair_dim).contiguous(), mask.reshape(positions).contiguous()
    products = _Products((kernels.position_gemm or "") if mode == "highest" and on_device else None)
    contractions = _KernelContractions(contract) if contract else _BmmContractions(products)

    # The forward again, up to z: x_hat, proj = [pa | ga | pb | gb], a and b planes.
    if not on_device:
        w_in = torch.cat([pa_w, ga_w, pb_w, gb_w])
        w_in_f, b_in_f = _folded(w_in, torch.cat([pa_b, ga_b, pb_b, gb_b]), ln_in_w, ln_in_b)
    rstd_in = None if saved_rstd is None else _saved_x_hat_rstd(saved_rstd, saved_x_hat, positions)
    x_hat = inputs.input_rows(pair_rows, eps_in, dtype) if saved_x_hat is None else \
        _saved_x_hat_rows(saved_x_hat, positions, pair_dim, dtype)
    del saved_x_hat, saved_rstd
    # (proj_in_pass: d_proj recomputes proj from x_hat itself, so proj lives only until gated_planes)
    proj_in_pass, proj = inputs.d_proj_from_x_hat(), None
    # d_pair_in_proj: d_proj writes d pair too, from the kept x_hat and rstd (training_backward in bindings.cpp)
    d_pair_in_proj = pair_grad and rstd_in is not None and gate_normalized and proj_in_pass and \
        inputs.d_pair_in_d_proj()
    if saved_ab is not None:
        a_planes, b_planes = _saved_ab_planes(saved_ab, saved_z, batch, n, hidden, dtype)
        del saved_ab
        if not lean and not proj_in_pass:  # (for d_proj; lean makes it there)
            proj = products.linear(x_hat, w_in_f, b_in_f)
    else:
        proj = products.linear(x_hat, w_in_f, b_in_f)
        a_planes, b_planes = inputs.gated_planes(proj, mask_rows, batch, n, incoming)
        if lean or proj_in_pass:
            proj = None
    z_planes = contractions.z(a_planes, b_planes) if saved_z is None else \
        _saved_z_planes(saved_z, batch, n, hidden, dtype)
    del saved_z

    # output_backward: out = sigmoid(gate_rows W_g^T + b_g) * (z_hat W_out_f^T + b_out_f).
    if not on_device:
        w_out_f, b_out_f = _folded(out_w, out_b, ln_out_w, ln_out_b)
        w_gate, b_gate = _folded(gate_w, gate_b, ln_in_w, ln_in_b) if gate_normalized else (gate_w, gate_b)
    gate_rows = x_hat if gate_normalized else pair_rows.to(dtype)
    d_out = grad_out.reshape(positions, pair_dim).contiguous()
    gate_from_z = outputs.gate_grad_from_z()
    # (d_pair multiplies d x_hat itself: never written)
    d_x_hat_in_pass = not d_pair_in_proj and inputs.d_pair_from_d_proj()
    # joined: d proj and d gate as the two parts of one [P, 4H + C] buffer, so that d x_hat is one GEMM against
    # [W_in_f; W_gate_f] (training_backward in bindings.cpp says why)
    joined = pair_grad and gate_normalized and not d_x_hat_in_pass and not proj_in_pass and not lean and \
        not gate_from_z
    d_rows = x_hat.new_empty((positions, 4 * hidden + pair_dim)) if joined else None
    if gate_from_z:  # (one pass: o and gate_pre never written)
        z_hat, rstd_out, d_o, d_gate, s_out, s_gate = outputs.z_gate_grad(z_planes, eps_out, gate_rows, w_out_f,
                                                                           b_out_f, w_gate, b_gate, d_out)
        del z_planes
    else:
        z_hat, rstd_out = outputs.z_rows(z_planes, batch, n, eps_out, dtype)
        del z_planes
        o = products.linear(z_hat, w_out_f, b_out_f)
        gate_pre = products.linear(gate_rows, w_gate, b_gate)
        d_o, d_gate, s_out, s_gate = outputs.gate_grad(d_out, o, gate_pre,
                                                       None if d_rows is None else d_rows[:, 4 * hidden:])
        del o, gate_pre
    del d_out
    g_gate = products.rows_grad(d_gate, gate_rows, acc) if params_grad else None
    del gate_rows
    g_out_in_pass = params_grad and outputs.g_out_in_dz_planes()  # (d z_hat and g_out multiplied in the pass)
    g_out = products.rows_grad(d_o, z_hat, acc) if params_grad and not g_out_in_pass else None
    if g_out_in_pass:
        dz_planes, g_out = outputs.dz_planes_g_out(d_o, w_out_f, z_hat, rstd_out)
        del d_o
    elif outputs.dz_planes_from_d_o():  # (d z_hat multiplied in the pass, never written)
        dz_planes = outputs.dz_planes_multiplied(d_o, w_out_f, z_hat, rstd_out)
        del d_o
    else:
        d_z_hat = products.rows_mm(d_o, w_out_f.to(dtype), acc)
        del d_o
        dz_planes = outputs.dz_planes(d_z_hat, z_hat, rstd_out, batch, n, dtype)
        del d_z_hat
    del z_hat

    # contract_backward
    da_planes, db_planes = contractions.grads(a_planes, b_planes, dz_planes)
    del a_planes, b_planes, dz_planes

    # input_backward
    if d_pair_in_proj:
        d_proj, d_mask, s_in, d_pair = inputs.d_proj_d_pair(x_hat, rstd_in, eps_in, w_in_f, b_in_f, da_planes,
                                                            db_planes, mask_rows, mask_grad, d_gate, w_gate,
                                                            pair_rows)
        del rstd_in
    elif proj_in_pass:
        d_proj, d_mask, s_in = inputs.d_proj_recomputed(x_hat, w_in_f, b_in_f, da_planes, db_planes, mask_rows,
                                                        mask_grad)
    else:
        if lean:  # (the same GEMM as above, the same bits; d proj then overwrites it where the passes allow)
            proj = products.linear(x_hat, w_in_f, b_in_f)
        d_proj, d_mask, s_in = inputs.d_proj(proj, da_planes, db_planes, mask_rows, batch, n, incoming, mask_grad,
                                             in_place=lean, out=None if d_rows is None else d_rows[:, :4 * hidden])
    del proj, da_planes, db_planes
    g_in = products.rows_grad(d_proj, x_hat, acc) if params_grad else None
    if not pair_grad:
        d_pair = None
        del d_proj
    elif d_pair_in_proj:
        del d_proj
    elif d_x_hat_in_pass:
        raw_gate_share = None if gate_normalized else products.rows_mm(d_gate, gate_w.to(dtype), acc)
        gate_share = (d_gate, w_gate) if gate_normalized else (None, None)
        d_pair = inputs.d_pair_multiplied(pair_rows, eps_in, d_proj, w_in_f, *gate_share, raw_gate_share)
        del d_proj
    elif joined:
        d_x_hat = products.rows_mm(d_rows, torch.cat([w_in_f, w_gate]).to(dtype), acc)
        del d_proj, d_rows
        d_pair = inputs.d_pair(pair_rows, eps_in, d_x_hat)
        del d_x_hat
    else:
        d_x_hat = products.rows_mm(d_proj, w_in_f.to(dtype), acc)
        del d_proj
        if gate_normalized:
            products.add_mm_(d_x_hat, d_gate, w_gate.to(dtype))
        # (after d proj is freed: the two [P, C] fp32 buffers, not three, at this point's peak)
        raw_gate_share = None if gate_normalized else products.rows_mm(d_gate, gate_w.to(dtype), acc)
        d_pair = inputs.d_pair(pair_rows, eps_in, d_x_hat, raw_gate_share)
        del d_x_hat
    del d_gate

    if not params_grad:
        return d_pair, d_mask, [None] * len(params)
    folded = (g_in, s_in, g_out, s_out, g_gate, s_gate)
    if on_device:  # (the extension's param_grads, as the one-call backward runs it: the same bits)
        return d_pair, d_mask, _extension().param_grads(list(params), params_acc, *(t.float() for t in folded),
                                                        gate_normalized)
    return d_pair, d_mask, _parameter_grads(params_acc, w_in, folded, gate_normalized)


def _parameter_grads(params_acc, w_in, folded, gate_normalized):
    """The sixteen parameters' gradients, in _param_list's order, from the folded GEMMs' (g: d_out^T x_hat, s: the
    sums of d_out, or a pass's partial sums) of the input projections (w_in: [pa; ga; pb; gb]), the output
    projection and the output gate: H x C and C x C matrices, no position loop. LayerNorm_in's gradients take the
    input projections' share and, where the gate reads x_hat, the gate's."""
    ln_in_w, ln_in_b, *_, ln_out_w, ln_out_b, out_w, _, gate_w, _ = params_acc
    g_in, s_in, g_out, s_out, g_gate, s_gate = folded
    s_in, s_out, s_gate = (_summed(s) for s in (s_in, s_out, s_gate))
    d_w_in, d_b_in, d_ln_in_w, d_ln_in_b = _unfolded_grads(g_in, s_in, w_in, ln_in_w, ln_in_b)
    d_out_w, d_out_b, d_ln_out_w, d_ln_out_b = _unfolded_grads(g_out, s_out, out_w, ln_out_w, ln_out_b)
    if gate_normalized:
        d_gate_w, d_gate_b, d_ln_w, d_ln_b = _unfolded_grads(g_gate, s_gate, gate_w, ln_in_w, ln_in_b)
        d_ln_in_w, d_ln_in_b = d_ln_in_w + d_ln_w, d_ln_in_b + d_ln_b
    else:
        d_gate_w, d_gate_b = g_gate, s_gate
    d_pa_w, d_ga_w, d_pb_w, d_gb_w = d_w_in.chunk(4)
    d_pa_b, d_ga_b, d_pb_b, d_gb_b = d_b_in.chunk(4)
    return [d_ln_in_w, d_ln_in_b, d_pa_w, d_pa_b, d_ga_w, d_ga_b, d_pb_w, d_pb_b, d_gb_w, d_gb_b,
            d_ln_out_w, d_ln_out_b, d_out_w, d_out_b, d_gate_w, d_gate_b]


@torch.library.custom_op("trimul_inline::trimul", mutates_args=())
def trimul(pair: torch.Tensor, mask: torch.Tensor, params: list[torch.Tensor], weights: list[torch.Tensor],
           kernels: str, mode: str, incoming: bool, gate_normalized: bool, eps_in: float, eps_out: float,
           keep: bool = False, lean: bool = False, graph_capture: bool = False) -> list[torch.Tensor]:
    """The fused forward with a backward (register_autograd): params are the 16 parameters (_PARAM_PATHS order,
    what the gradients are for), weights their prepare_weights layout (what the forward reads); kernels a
    Kernels string ("auto", "role=name,..."). Returns [out, z, a/b, x_hat, x_hat's rstd]: out the layer's output,
    the other four what the forward keeps for the backward where `keep` (ModelNew's backward_saves; else and
    where the forward cannot keep one: empty), flat (_kept_views gives their shapes back; their sizes depend on
    the plan, so the fake gives them sizes known only at run time) and not differentiable; the backward then
    runs lean if `lean` (training_backward), and may capture a small call's CUDA graph if `graph_capture` (False
    where inductor puts the step in CUDA graphs: training_backward's graph_capture)."""
    out, *kept = _trimul_forward(pair, mask, params, weights, kernels, mode, incoming, gate_normalized, eps_in,
                                 eps_out, keep_z=keep)
    return [out] + [pair.new_empty((0,), dtype=dtype) if t is None else t.reshape(-1)
                    for t, dtype in zip(kept, _kept_dtypes(mode, pair))]


def _kept_dtypes(mode: str, pair: torch.Tensor) -> list[torch.dtype]:
    """The dtypes of what a training forward keeps (_trimul_forward): z, a/b and x_hat in the backward's operand
    dtype (float64 for a float64 pair, as _training_backward computes; on CUDA x_hat only where that is bf16), its
    rstd fp32."""
    operand = torch.float64 if pair.dtype == torch.float64 else _backward_dtype(mode, pair)
    return [operand, operand, operand, torch.float32]


def _kept_views(kept: list[torch.Tensor], pair: torch.Tensor, hidden: int) -> list[Optional[torch.Tensor]]:
    """trimul's flat kept buffers as training_backward's `saved` list: z [B*H, N, ldz], a/b [2, B*H, N, ld],
    x_hat [B*N*N, C], its rstd [B*N*N]; None for each not kept (a/b and rstd only with z and x_hat)."""
    batch, n = pair.shape[0], pair.shape[1]
    z, ab, x_hat, rstd = (t if t.numel() else None for t in kept)
    z = None if z is None else z.view(batch * hidden, n, -1)
    ab = None if ab is None or z is None else ab.view(2, batch * hidden, n, -1)
    x_hat = None if x_hat is None else x_hat.view(batch * n * n, -1)
    return [z, ab, x_hat, None if x_hat is None else rstd]


def _trimul_forward(pair, mask, params, weights, kernels, mode, incoming, gate_normalized, eps_in, eps_out,
                    keep_z: bool):
    """trimul's forward, for the op and for _TrimulFunction: (out, z, ab, x_hat, x_hat_rstd), the last four None
    unless keep_z: z the forward's planes [B*H, N, ldz] where they can stand in for the backward's
    recomputed ones (the fused steps write z in the backward's operand dtype; else None), ab its a/b planes
    [2, B*H, N, ld] where they can (whole values in the operand dtype: the 16-bit modes; else None), x_hat
    LayerNorm_in's rows [B*N*N, C] where the input kernel wrote them in the operand dtype (bf16; else None),
    x_hat_rstd their rstd [B*N*N] fp32 (with x_hat)."""
    if not pair.is_cuda:  # (the op runs anywhere: off CUDA it is the reference computation)
        if not keep_z:
            return _functional_reference(pair, mask, params, incoming, gate_normalized, eps_in, eps_out), \
                None, None, None, None
        return _reference_keeping(pair, mask, params, mode, incoming, gate_normalized, eps_in, eps_out)
    chosen = parse_kernels(kernels)
    hidden = params[2].shape[0]
    if not keep_z:
        out = _run_fused_forward(pair, mask, weights, chosen[:len(FORWARD_ROLES)], mode, incoming, gate_normalized,
                                 eps_in, eps_out, hidden)
        return out, None, None, None, None
    options = _forward_options(chosen[:len(FORWARD_ROLES)], mode, incoming, gate_normalized, eps_in, eps_out, hidden)
    steps = ForwardSteps(pair, mask, weights, options, mode)
    operand = _backward_dtype(mode, pair)
    ab, z, out = steps.new_ab(), steps.new_z(), steps.new_out()
    x_hat = steps.new_x_hat() if operand == torch.bfloat16 else None
    x_hat_rstd = steps.new_x_hat_rstd() if x_hat is not None else None
    steps.input_pass(ab, x_hat, x_hat_rstd)
    steps.contraction(ab, z)
    if _gate_reads_x_hat(steps.plan, x_hat, chosen.output, gate_normalized):
        raw_gate = _forward_options(chosen[:len(FORWARD_ROLES)], mode, incoming, False, eps_in, eps_out, hidden)
        steps.output_pass(out, z=z, ab=ab, gate_rows=(x_hat, _x_hat_gate_weights(weights, params), raw_gate))
    else:
        steps.output_pass(out, z=z, ab=ab)
    whole_ab = ab.dtype == operand and ab.shape[1] == pair.shape[0] * hidden  # (not split parts, not scaled fp16)
    kept_z = z if z is not None and z.dtype == operand else None
    return out, kept_z, ab if whole_ab and operand != torch.float32 else None, x_hat, x_hat_rstd


def _refuse_create_graph() -> None:
    """In a backward: raise where autograd asked for a differentiable one (create_graph=True). The kernels'
    backward is not differentiable again, and once_differentiable's guard does not reach a second derivative
    taken by torch.autograd.grad (it would come back silently without the layer's term)."""
    if torch.is_grad_enabled():
        raise RuntimeError("trimul_inline: the layer's backward is not differentiable (create_graph=True, as for "
                           "second derivatives or gradient penalties through it, is not supported)")


class _TrimulFunction(torch.autograd.Function):
    """`trimul` for eager calls: the op's forward and backward without the dispatcher around them (for an op
    whose arguments are ~35 tensors, flattening and alias checks cost ~0.7 ms per call on the H200's host: most
    of a small training step). torch.compile traces the op, opcheck checks it, and tests hold the two to equal
    gradients. apply(pair, mask, weights, kernels, mode, incoming, gate_normalized, eps_in, eps_out, keep_z,
    lean, *params); keep_z: the forward's z planes kept for the backward (ModelNew's backward_saves), which then
    runs lean if `lean` (training_backward). The kept buffers are intermediates: on the context, so that the
    backward can free each after its last use; under torch.utils.checkpoint's hooks saved tensors instead
    (_saves_z says why)."""

    @staticmethod
    def forward(ctx, pair, mask, weights, kernels, mode, incoming, gate_normalized, eps_in, eps_out, keep_z, lean,
                *params):
        ctx.options = (kernels, mode, incoming, gate_normalized, eps_in, eps_out)
        ctx.lean = lean
        out, z, ab, x_hat, x_hat_rstd = _trimul_forward(pair, mask, list(params), weights, kernels, mode, incoming,
                                                        gate_normalized, eps_in, eps_out, keep_z=keep_z)
        kept = [z, ab if z is not None else None, x_hat, x_hat_rstd]
        ctx.kept_saved = keep_z and _checkpoint_hooks_active()
        ctx.save_for_backward(pair, mask, *params, *(kept if ctx.kept_saved else []))
        ctx.kept = None if ctx.kept_saved else kept
        return out

    @staticmethod
    def backward(ctx, grad_out):
        _refuse_create_graph()
        pair, mask, *params = ctx.saved_tensors
        kernels, *options = ctx.options
        wanted = ctx.needs_input_grad
        # (intermediates, not inputs or outputs: handed over so that each is freed once used; checkpoint's
        # recompute held them only until unpacked. A second backward (retain_graph) finds none: it recomputes.)
        saved = params[16:] if ctx.kept_saved else (ctx.kept or [None] * 4)  # (saved: after the 16 parameters)
        del params[16:]
        ctx.kept = None
        lean = saved[0] is not None and ctx.lean
        d_pair, d_mask, *d_params = training_backward(grad_out.contiguous(), pair, mask, params,
                                                      parse_kernels(kernels), *options, bool(wanted[1]),
                                                      saved=saved, lean=lean, pair_grad=bool(wanted[0]),
                                                      params_grad=any(wanted[11:]))
        return (d_pair if wanted[0] else None, d_mask if wanted[1] else None) + (None,) * 9 + \
            tuple(g if w else None for g, w in zip(d_params, wanted[11:]))


def _reference_keeping(pair, mask, params, mode, incoming, gate_normalized, eps_in, eps_out):
    """_functional_reference (the same steps, the same output) with what the fused forward keeps, in its layouts
    and dtypes (_kept_dtypes): z's planes [B*H, N, N], the a/b planes [2, B*H, N, N], LayerNorm_in's rows without
    the affine [B*N*N, C] and their rstd."""
    out, a, b, z = _reference_steps(pair, mask, params, incoming, gate_normalized, eps_in, eps_out)
    batch, n, _, pair_dim = pair.shape
    operand, _, _, rstd_dtype = _kept_dtypes(mode, pair)
    planes = lambda t, transposed: _planes(t.reshape(-1, t.shape[-1]), batch, n, transposed).to(operand)  # noqa: E731
    x_hat, rstd = _normalized_rows(pair.reshape(-1, pair_dim), eps_in)
    return (out, planes(z, False), torch.stack([planes(a, incoming), planes(b, incoming)]), x_hat.to(operand),
            rstd.reshape(-1).to(rstd_dtype))


def _layer_norm_in(params, rows, eps_in):
    """LayerNorm_in of `rows` [..., C] on a parameter list (_PARAM_PATHS order: its weight and bias first)."""
    return torch.nn.functional.layer_norm(rows, rows.shape[-1:], params[0], params[1], eps_in)


def _layers_in(params, pair, mask, eps_in, cast_mask=False):
    """x = LayerNorm_in(pair) and a, b = proj(x) * sigmoid(gate(x)) * mask ([B, rows, N, H]) on a parameter list
    (_PARAM_PATHS order). cast_mask: the mask in a's dtype first (under autocast a stays bf16)."""
    pa_w, pa_b, ga_w, ga_b, pb_w, pb_b, gb_w, gb_b = params[2:10]
    linear = torch.nn.functional.linear
    x = _layer_norm_in(params, pair, eps_in)
    m = mask.unsqueeze(-1)

    def gated(proj_w, proj_b, gate_w, gate_b):
        p = linear(x, proj_w, proj_b) * torch.sigmoid(linear(x, gate_w, gate_b))
        return p * (m.to(p.dtype) if cast_mask else m)
    return x, gated(pa_w, pa_b, ga_w, ga_b), gated(pb_w, pb_b, gb_w, gb_b)


def _layers_out(params, z, gate_source, eps_out):
    """sigmoid(out_gate(gate_source)) * out_proj(LayerNorm_out(z)) on a parameter list (_PARAM_PATHS order)."""
    ln_w, ln_b, out_w, out_b, gate_w, gate_b = params[10:]
    linear = torch.nn.functional.linear
    o = linear(torch.nn.functional.layer_norm(z, z.shape[-1:], ln_w, ln_b, eps_out), out_w, out_b)
    return torch.sigmoid(linear(gate_source, gate_w, gate_b)) * o


def _reference_steps(pair, mask, params, incoming, gate_normalized, eps_in, eps_out):
    """reference_forward on a parameter list (_PARAM_PATHS order): (out, a, b, z); the mask in a's dtype (a
    float32 mask beside a bf16 pair would otherwise promote a, z and then LayerNorm_out's input past the
    parameters' dtype)."""
    x, a, b = _layers_in(params, pair, mask, eps_in, cast_mask=True)
    z = torch.einsum("bkih,bkjh->bijh" if incoming else "bikh,bjkh->bijh", a, b)
    return _layers_out(params, z, x if gate_normalized else pair, eps_out), a, b, z


def _functional_reference(pair, mask, params, incoming, gate_normalized, eps_in, eps_out):
    """_reference_steps' output."""
    return _reference_steps(pair, mask, params, incoming, gate_normalized, eps_in, eps_out)[0]


@trimul.register_fake
def _trimul_fake(pair, mask, params, weights, kernels, mode, incoming, gate_normalized, eps_in, eps_out, keep=False,
                 lean=False, graph_capture=False):
    out = torch.empty_like(pair, memory_format=torch.contiguous_format)
    sizes = [torch.library.get_ctx().new_dynamic_size() if keep else 0 for _ in range(4)]
    return [out] + [pair.new_empty((size,), dtype=dtype) for size, dtype in zip(sizes, _kept_dtypes(mode, pair))]


def _trimul_setup_context(ctx, inputs, output):
    pair, mask, params, weights, *options = inputs
    ctx.save_for_backward(pair, mask, *params, *output[1:])
    ctx.mark_non_differentiable(*output[1:])
    # (no zeros made for the gradients nobody passes: the kept buffers' four would be B*H*N^2 values three times
    # over and B*N^2*C more, made at the backward's start where the op runs eagerly through the dispatcher: a
    # direct call, or one at a graph break. out's always comes: the node runs only once a gradient reaches it,
    # and the kept buffers are not differentiable)
    ctx.set_materialize_grads(False)
    ctx.options = options[:6]
    ctx.lean = options[7] if len(options) > 7 else False
    ctx.graph_capture = options[8] if len(options) > 8 else False
    ctx.weight_count = len(weights)


def _trimul_backward(ctx, grads):
    pair, mask, *params = ctx.saved_tensors
    kept = params[16:]
    del params[16:]
    wanted = ctx.needs_input_grad
    mask_grad = bool(wanted[1])
    d_pair, d_mask, *d_params = trimul_backward(grads[0].contiguous(), pair, mask, params, *ctx.options, mask_grad,
                                                bool(wanted[0]), any(wanted[2]), *kept, ctx.lean, ctx.graph_capture)
    return ((d_pair if wanted[0] else None, d_mask if mask_grad else None,
             [g if w else None for g, w in zip(d_params, wanted[2])], [None] * ctx.weight_count) +
            (None,) * (len(wanted) - 4))  # (one per input passed: the dispatcher drops those equal to defaults)


trimul.register_autograd(_trimul_backward, setup_context=_trimul_setup_context)


@torch.library.custom_op("trimul_inline::trimul_backward", mutates_args=())
def trimul_backward(grad_out: torch.Tensor, pair: torch.Tensor, mask: torch.Tensor, params: list[torch.Tensor],
                    kernels: str, mode: str, incoming: bool, gate_normalized: bool, eps_in: float, eps_out: float,
                    mask_grad: bool, pair_grad: bool = True, params_grad: bool = True,
                    kept_z: Optional[torch.Tensor] = None, kept_ab: Optional[torch.Tensor] = None,
                    kept_x_hat: Optional[torch.Tensor] = None, kept_x_hat_rstd: Optional[torch.Tensor] = None,
                    lean: bool = False, graph_capture: bool = False) -> list[torch.Tensor]:
    """trimul's backward (training_backward): [d pair, d mask, d params...], each empty where not wanted (d mask
    unless mask_grad, d pair unless pair_grad, the parameters' unless params_grad: their work skipped). kept_*:
    trimul's four kept buffers (flat, empty where not kept), read instead of recomputed (not written); lean and
    graph_capture: as training_backward's (lean where z is kept)."""
    kept = [kept_z, kept_ab, kept_x_hat, kept_x_hat_rstd]
    saved = None if any(t is None for t in kept) else _kept_views(kept, pair, params[2].shape[0])
    grads = training_backward(grad_out, pair, mask, params, parse_kernels(kernels), mode, incoming, gate_normalized,
                              eps_in, eps_out, mask_grad, saved=saved,
                              lean=lean and saved is not None and saved[0] is not None, pair_grad=pair_grad,
                              params_grad=params_grad, graph_capture=graph_capture)
    if grads[1] is None:
        grads[1] = mask.new_empty((0,), dtype=_grad_mask_dtype(mask))
    return [t.new_empty((0,)) if g is None else g for g, t in zip(grads, [pair, mask] + list(params))]


def _grad_mask_dtype(mask):
    return mask.dtype if mask.is_floating_point() else torch.float32


@trimul_backward.register_fake
def _trimul_backward_fake(grad_out, pair, mask, params, kernels, mode, incoming, gate_normalized, eps_in, eps_out,
                          mask_grad, pair_grad=True, params_grad=True, kept_z=None, kept_ab=None, kept_x_hat=None,
                          kept_x_hat_rstd=None, lean=False, graph_capture=False):
    # (contiguous, as the op's gradients are: views of fresh buffers, whatever the inputs' strides)
    d_mask = mask.new_empty(mask.shape) if mask_grad else mask.new_empty((0,), dtype=_grad_mask_dtype(mask))
    d_pair = pair.new_empty(pair.shape) if pair_grad else pair.new_empty((0,))
    return [d_pair, d_mask] + [p.new_empty(p.shape) if params_grad else p.new_empty((0,)) for p in params]


# ------------------------------------------------------------------------------------------------
# ModelNew
# ------------------------------------------------------------------------------------------------
def _float32_matmul_precision_now() -> str:
    return torch.get_float32_matmul_precision()


_TAKES = {}  # (kernel library, device, pair_dim, hidden, mode, pair dtype) -> whether the fused passes take it


def _fused_takes_now(pair_dim: int, hidden: int, mode: str, pair_dtype: torch.dtype) -> bool:
    extension = _extension()
    key = (extension.kernel_library, torch.cuda.current_device(), pair_dim, hidden, mode, pair_dtype)
    if key not in _TAKES:
        _TAKES[key] = bool(extension.fused_takes(pair_dim, hidden, _MODE_CODE[mode], _DTYPE_CODE[pair_dtype]))
    return _TAKES[key]


# Under torch.compile these are read once, at trace time (dynamo cannot trace into them).
_float32_matmul_precision_now = torch.compiler.assume_constant_result(_float32_matmul_precision_now)
_fused_takes_now = torch.compiler.assume_constant_result(_fused_takes_now)
_kernels_override = torch.compiler.assume_constant_result(_kernels_override)
_kernels_run_on = torch.compiler.assume_constant_result(_kernels_run_on)

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the CUDA kernels take


def _kernels_take(t: torch.Tensor) -> bool:
    """Whether the CUDA kernels take tensors like t: a dtype they compute in, on a GPU they are for."""
    return t.is_cuda and t.dtype in _KERNEL_DTYPES and _kernels_run_on(t.device.index)


_FUSED_MASK_DTYPES = (torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32,
                      torch.bfloat16, torch.float16)  # read as they are by the fused kernels
_reference_warned = set()


def check_inputs(layers: _TriMulLayers, pair_repr, pair_mask, rows: Optional[int] = None) -> None:
    """The one input check of every path (fused kernels, autograd path, reference fallback, a rank's block):
    raises ValueError/TypeError naming the problem; silent for good input. rows: a sharded rank's row count
    (pair_repr (B, rows, N, C)); None: all N."""
    for name, value in (("pair_repr", pair_repr), ("pair_mask", pair_mask)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    shape = tuple(pair_repr.shape)
    if pair_repr.dim() != 4:
        raise ValueError(f"pair_repr must have shape (B, N, N, C); got {shape} ({pair_repr.dim()}-D)")
    batch, n_rows, n_cols, channels = shape
    if n_rows != (n_cols if rows is None else rows):
        raise ValueError(f"pair_repr must be (B, N, N, C) with equal middle dims; got {shape}" if rows is None else
                         f"pair_repr must be this rank's rows (B, {rows}, N, C); got {shape}")
    if channels != layers.pair_dim:
        raise ValueError(f"pair_repr has C={channels} channels but the model has "
                         f"pair_dim={layers.pair_dim}")
    if tuple(pair_mask.shape) != (batch, n_rows, n_cols):
        raise ValueError(f"pair_mask must have shape {'(B, N, N)' if rows is None else '(B, N_r, N)'} = "
                         f"{(batch, n_rows, n_cols)} to match pair_repr {shape}; got {tuple(pair_mask.shape)}")
    if not pair_repr.is_floating_point():
        raise TypeError(f"pair_repr must be a floating-point tensor; got {pair_repr.dtype}")
    if pair_mask.is_complex():
        raise TypeError(f"pair_mask must be bool, integer or floating; got {pair_mask.dtype}")
    if pair_mask.device != pair_repr.device:
        raise ValueError(f"pair_mask is on {pair_mask.device} but pair_repr is on "
                         f"{pair_repr.device}; put both on one device")
    weight = _param_list_eager(layers)[2]
    if weight.device != pair_repr.device:
        raise ValueError(f"pair_repr is on {pair_repr.device} but the model's parameters are on "
                         f"{weight.device}; call model.to({str(pair_repr.device)!r})")
    autocast = pair_repr.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(pair_repr.device.type)
    if pair_repr.dtype != weight.dtype and not autocast:
        raise TypeError(f"pair_repr is {pair_repr.dtype} but the parameters are {weight.dtype}; "
                        f"convert the model (model.to({pair_repr.dtype})) or use torch.autocast")


def _warn_reference_once(pair_repr, functorch: bool = False) -> None:
    """Once per device and dtype (and once for torch.func's transforms): why ModelNew runs the reference."""
    if torch.compiler.is_compiling():  # (dynamo cannot trace warnings.warn: fullgraph would break here)
        return
    key = ("torch.func",) if functorch else (pair_repr.device.type, pair_repr.device.index, pair_repr.dtype)
    if key in _reference_warned:
        return
    _reference_warned.add(key)
    if functorch:
        what, why = "a call under torch.func (grad, vmap, jacrev...)", "the kernels have no functorch rules"
    elif pair_repr.device.type == "cpu" or pair_repr.dtype not in _KERNEL_DTYPES:
        what = "CPU tensors" if pair_repr.device.type == "cpu" else f"{pair_repr.dtype} tensors"
        why = "the CUDA kernels take float32, bfloat16 and float16 on a GPU"
    else:
        capability = ".".join(map(str, torch.cuda.get_device_capability(pair_repr.device.index)))
        what = f"tensors on {pair_repr.device}, a GPU of compute capability {capability}"
        why = f"the CUDA kernels need {'.'.join(map(str, MIN_COMPUTE_CAPABILITY))} or newer"
    warnings.warn(f"trimul_inline: ModelNew got {what}; running the reference computation ({why})", stacklevel=3)


def _contraction_layout(t: torch.Tensor, direction: str) -> torch.Tensor:
    """[B, N, N, H] projections -> [B*H, i, k] so both directions are one a @ b^T per (b, h)."""
    batch, n, _, hidden = t.shape
    order = (0, 3, 1, 2) if direction == "outgoing" else (0, 3, 2, 1)
    return t.permute(order).contiguous().view(batch * hidden, n, n)


class ModelNew(_TriMulLayers):
    """Model's computation on the CUDA kernels of kernels/.

    direction: "outgoing" (z[i, j] = sum_k a[i, k] b[j, k]) or "incoming" (sum_k a[k, i] b[k, j]).
    gate_input: what the output gate reads: "raw" (the seed's: pair_repr) or "normalized" (LayerNorm_in's
        output: AlphaFold2, OpenFold, Boltz, cuEquivariance).
    kernels: the kernel of each role (Kernels, a mapping {role: name} or "role=name,..."; see
        `python trimul_inline.py kernels`); None: each role's default order.
    precision: for fp32 inputs, "highest" | "high" | "medium"; None follows
        torch.get_float32_matmul_precision(). bf16/fp16 inputs compute in their dtype.
    bias: False: the six Linears have no bias (OpenFold3 / Protenix / Boltz), as Model(bias=False).
    process_group: a torch.distributed group over which the pair tensor is sharded by rows: each rank passes
        its rows (B, N_r, N, C) and mask (B, N_r, N), rank r holding torch.tensor_split(torch.arange(N), P)[r],
        and gets the same rows of the output; parameter gradients are each rank's rows' share (their sum over the
        group, as DDP's all-reduce gives, is the full gradient).
    shard_exchange: how the sharded contraction crosses ranks: "ring" (b's row blocks round the ring; incoming
        adds an all-to-all of a), "channels" (a and b to the rank owning their hidden channels, z's rows back);
        None: shard_exchange_for(direction, world). Results agree to rounding; only the time and bytes differ.
    backward_saves: what the training forward keeps for the backward: "inputs", "z" (z and, in 16 bits, the a/b
        planes: one N^3 product fewer, a smaller backward peak), None: the rule of _saves_z (README, Training).
        Sharded (process_group): "z" keeps the per-position layers' intermediates; "inputs" and None recompute
        them in the backward, a few rows at a time (faster and smaller, as measured).
    Inputs the CUDA kernels do not take (CPU tensors, float64, GPUs older than sm_80) and calls under torch.func
    transforms run the reference computation (warning once).
    """

    def __init__(self, pair_dim: int, hidden_dim: int, direction: str = "outgoing",
                 gate_input: str = "raw", kernels=None, precision: Optional[str] = None, bias: bool = True,
                 process_group=None, backward_saves: Optional[str] = None, shard_exchange: Optional[str] = None):
        super().__init__(pair_dim, hidden_dim, direction, gate_input, bias)
        if shard_exchange not in (None,) + SHARD_EXCHANGES:
            raise ValueError(f"shard_exchange must be None or one of {SHARD_EXCHANGES}, got {shard_exchange!r}")
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"precision must be None or one of {PRECISIONS}, got {precision!r}")
        if backward_saves not in (None,) + BACKWARD_SAVES:
            raise ValueError(f"backward_saves must be None or one of {BACKWARD_SAVES}, got {backward_saves!r}")
        self.kernels, self.precision, self.backward_saves = parse_kernels(kernels), precision, backward_saves
        self.process_group = process_group  # not state: a process group does not pickle
        self.shard_exchange = shard_exchange
        self._weights_cache = {}  # mode -> (parameter versions, prepared weights, held storages); not state
        self._plans = {}  # call signature -> (mode, kernels, ForwardOptions, extension, gated) (see _plan_key)
        self._gate_choices = {}  # call signature -> (extension, whether forward() gates on x_hat there)
        self._fast = None  # (extension, the last planned signature's decisions checked in C++: _fast_plan)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, kernels={str(self.kernels)!r}, precision={self.precision!r}"
                + (f", backward_saves={self.backward_saves!r}" if self.backward_saves is not None else "")
                + (", process_group=<set>" if self.process_group is not None else "")
                + (f", shard_exchange={self.shard_exchange!r}" if self.shard_exchange is not None else ""))

    @classmethod
    def from_alphafold_params(cls, params, direction: str, kernels=None, precision: Optional[str] = None):
        """A ModelNew from one AlphaFold2 triangle-multiplication block's Haiku parameters: a mapping from module
        names (full Haiku paths or their last component: layer_norm_input, left_projection, right_projection,
        left_gate, right_gate, center_layer_norm, output_projection, gating_linear) to {"weights", "bias"} or
        {"scale", "offset"} arrays (numpy or torch; Linear weights [in, out]), or AlphaFold's flat checkpoint keys
        ("path/left_projection//weights"). The fused form (AlphaFold-Multimer v2.3: left_norm_input, projection and
        gate of 2 hidden outputs, left half then right, center_norm) is recognised by its `projection`. Incoming
        takes a from the right projections, as AlphaFold2 does; the gate reads the normalized input. In the
        arrays' dtype, on the CPU."""
        return _alphafold_model(cls, params, direction, kernels, precision)

    def resolved_precision(self) -> str:
        return self.precision or _float32_matmul_precision_now()

    def __getstate__(self):
        # (copy.deepcopy, pickle) the C++ plan and options do not copy; the copy plans its own calls. A process
        # group is the running program's, not the module's state: a copy runs unsharded until given one.
        state = self.__dict__.copy()
        state["_fast"] = None
        state["process_group"] = None
        state["_plans"] = {}
        state["_gate_choices"] = {}
        state["_weights_cache"] = {}  # (kernel-layout copies keyed by addresses: meaningless in a copy)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_fast", None)
        self.__dict__.setdefault("process_group", None)
        self.__dict__.setdefault("backward_saves", None)
        self.__dict__.setdefault("shard_exchange", None)
        self.__dict__.setdefault("_gate_choices", {})

    def forward(self, pair_repr: torch.Tensor, pair_mask: torch.Tensor,
                chunk_size: Optional[int] = None) -> torch.Tensor:
        """The update for pair_repr [B, N, N, C] and pair_mask [B, N, N]. chunk_size (inference only): the
        memory-bounded forward, `chunk_size` rows at a time (forward_chunked); None: the fused forward, or the
        chunked one where the fused forward's buffers would not fit in the GPU's free memory."""
        if chunk_size is not None:
            return self.forward_chunked(pair_repr, pair_mask, chunk_size)
        if self.process_group is not None:
            return self._forward_sharded(pair_repr, pair_mask)
        if not torch.compiler.is_compiling():
            if torch._C._are_functorch_transforms_active():  # (torch.func: the kernels' ops have no rules for it)
                check_inputs(self, pair_repr, pair_mask)
                _warn_reference_once(pair_repr, functorch=True)
                return self._reference(pair_repr, pair_mask)
            fast = self._fast
            # (planned by the extension in use, since the last optimizer step: a fused one bumps no version)
            if fast is not None and fast[0] is _DEFAULT_EXTENSION and fast[2] == _OPTIMIZER_STEPS[0]:
                out = fast[1].run(self, pair_repr, pair_mask, self.resolved_precision())
                if out is not None:
                    return out
        out = self._forward_planned(pair_repr, pair_mask)
        if out is not None:
            return out
        check_inputs(self, pair_repr, pair_mask)
        if not _kernels_take(pair_repr):
            _warn_reference_once(pair_repr)
            return self._reference(pair_repr, pair_mask)
        precision = self.resolved_precision()
        mode = compute_mode(pair_repr.dtype, precision)
        kernels = _with_override(self.kernels)
        if kernels.input is None and kernels.output is None and \
                not _fused_takes_now(self.pair_dim, self.hidden_dim, mode, pair_repr.dtype):
            return self._forward_unfused(pair_repr, pair_mask)
        if self._needs_autograd(pair_repr, pair_mask):
            return self._forward_trained(pair_repr, pair_mask, mode, kernels)
        return self._forward_fused(pair_repr, pair_mask, mode, kernels)

    def _reference(self, pair_repr, pair_mask):
        """The reference computation on this layer's parameters (plain PyTorch: composes with torch.func)."""
        return _functional_reference(pair_repr, pair_mask, _param_list(self), self.direction == "incoming",
                                     self.gate_input == "normalized", self.layer_norm_in.eps, self.layer_norm_out.eps)

    def forward_chunked(self, pair_repr: torch.Tensor, pair_mask: torch.Tensor, chunk_size: Optional[int] = None,
                        out: Optional[torch.Tensor] = None, add: bool = False,
                        lean: Optional[bool] = None) -> torch.Tensor:
        """The memory-bounded forward (inference): one side of the projection for every position (b outgoing,
        a incoming: B H N^2 operands), then the other side, the contraction and the output layers `chunk_size`
        rows (incoming: columns) at a time (None: sized by _chunk_plan). out: where the update goes
        (pair_repr itself for an in-place update: each chunk's positions are read before they are written);
        add: out += update (a residual). lean (in place only): True keeps the update within the pair's bytes
        (slower: part of the whole side is made twice); False keeps the whole side (the pair's bytes + a
        chunk); None: lean only where the whole side would not fit in the free memory."""
        check_inputs(self, pair_repr, pair_mask)
        if self._needs_autograd(pair_repr, pair_mask):
            raise RuntimeError("trimul_inline: the chunked forward is for inference; call it under torch.no_grad() "
                               "or torch.inference_mode() (training takes the fused forward and its backward)")
        if self.process_group is not None:
            raise ValueError("trimul_inline: the chunked forward runs on one device (this ModelNew has a "
                             "process_group: its rows are already split over ranks)")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                       or chunk_size < 1):
            raise ValueError(f"trimul_inline: chunk_size must be a positive int (rows per chunk) or None, got "
                             f"{chunk_size!r}")
        _check_chunked_out(pair_repr, out, add)
        if lean is not None and not isinstance(lean, bool):
            raise ValueError(f"trimul_inline: lean must be True, False or None, got {lean!r}")
        if pair_repr.numel() == 0:  # (B = 0 or N = 0: nothing to update)
            return torch.empty_like(pair_repr, memory_format=torch.contiguous_format) if out is None else out
        mode = compute_mode(pair_repr.dtype, self.resolved_precision())
        with torch.no_grad(), torch.autocast(pair_repr.device.type, enabled=False):
            return _chunked_update(self, pair_repr, pair_mask, _chunk_operand(pair_repr.dtype, mode), mode,
                                   chunk_size, out, add, lean)

    def update_(self, pair_repr: torch.Tensor, pair_mask: torch.Tensor,
                chunk_size: Optional[int] = None, lean: Optional[bool] = None) -> torch.Tensor:
        """pair_repr += the update, in place, chunk by chunk (no second [B, N, N, C] buffer): the residual step
        of inference (OpenFold's _add_with_inplace). lean: as forward_chunked's. Returns pair_repr."""
        return self.forward_chunked(pair_repr, pair_mask, chunk_size, out=pair_repr, add=True, lean=lean)

    def _needs_autograd(self, pair_repr, pair_mask) -> bool:
        if not torch.is_grad_enabled():
            return False
        return pair_repr.requires_grad or pair_mask.requires_grad or \
            any(p is not None and p.requires_grad for p in _param_list_eager(self))

    def _forward_trained(self, pair_repr, pair_mask, mode, kernels):
        """The fused forward as the differentiable op `trimul` (eagerly: _TrimulFunction, the same steps), whose
        backward runs the backward roles."""
        original = (pair_repr, pair_mask)
        pair_repr, pair_mask = self._fused_inputs(pair_repr, pair_mask)
        values = self._option_values(mode)[:-1]
        lean = _runs_lean(self.backward_saves, pair_repr.shape[0] * pair_repr.shape[1] * pair_repr.shape[2])
        compiling = torch.compiler.is_compiling()  # (then the hooks are not consulted: DESIGN.md "Saving z")
        keep_z = _saves_z(self.backward_saves, _graphs_backward(pair_repr, mode), pair_repr.is_cuda,
                          not compiling and _saved_tensor_hooks_active() and not _checkpoint_hooks_active())
        if compiling:  # (kept buffers as the op's outputs: saved tensors of the traced graph)
            # (where inductor's CUDA graphs run the step, the op keeps nothing and captures no graph of its own;
            # elsewhere a small backward replays its graph, as the eager step's does)
            in_cuda_graphs = _traced_for_cuda_graphs()
            keep_z = keep_z and not in_cuda_graphs
            if keep_z and not _traces_run_time_sizes():
                # (dynamo would break the graph at the op, whose kept buffers' sizes are known only at run time, and
                # run it through the dispatcher: the eager step at the break instead, the same kernels without the
                # dispatcher's per-call cost, each kept buffer freed after its last use; the inputs as converted
                # here, which the eager step's own conversion then leaves as they are)
                return _trained_eagerly(self, pair_repr, pair_mask, mode, kernels)
            params = _with_zero_biases(_param_list(self))
            return trimul(pair_repr, pair_mask, params, prepare_weights(params, mode), str(kernels), *values, keep_z,
                          lean, not in_cuda_graphs)[0]
        try:
            return _TrimulFunction.apply(pair_repr, pair_mask, self._prepared_weights(mode), str(kernels), *values,
                                         keep_z, lean, *_with_zero_biases(_param_list_eager(self)))
        except NotImplementedError:  # nothing of a default order takes this call: the unfused path
            return self._forward_unfused(*original)

    def _plan_key(self, pair_repr, pair_mask):
        """Everything check_inputs and the path choice read, apart from the parameters (whose
        changes clear the plans): equal keys get equal decisions and extension arguments."""
        autocast = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda")
        modules = self._modules
        return (pair_repr.shape, pair_repr.dtype, pair_repr.device, pair_repr.stride(-1), pair_mask.shape,
                pair_mask.dtype, pair_mask.device, self.resolved_precision(),
                autocast, self.kernels, self.direction, self.gate_input, modules["layer_norm_in"].eps,
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
        mode, kernels, options, extension, gated = plan
        weights, refreshed = self._prepared_weights_and_freshness(mode)
        if refreshed or extension is not _extension():  # parameters changed (device, dtype...), or a reload
            self._plans.clear()
            return None
        gate_weights = self._x_hat_gate_weights(weights) if gated else None
        with _bmm_precision(kernels, mode):
            return extension.forward(pair_repr, pair_mask, weights, options, gate_weights)

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
        """(prepared weights, whether they were just (re)made). Cached by the parameters' storages, addresses
        and version counters, and the count of torch.optim steps taken (_OPTIMIZER_STEPS)."""
        params = _param_list_eager(self)
        version = [None if p is None else (p.data_ptr(), p._version) for p in params]
        version.append(_OPTIMIZER_STEPS[0])
        cached = self._weights_cache.get(mode)
        if cached is not None and cached[0] == version:
            return cached[1], False
        # (the entry holds the storages it was prepared from: while it lives no other tensor can take their
        # addresses, so an equal (address, version) is the same storage, unchanged through tracked ops; a
        # parametrization's computed weight or functional_call's tensors of another call miss)
        held = [None if p is None else p.untyped_storage() for p in params]
        weights = _prepared_by_kernel(params, mode, x_hat_gate=self.gate_input == "normalized")
        if weights is None:
            graphed = _prepared_graphed(params, mode, capture=cached is not None)  # (a refresh: _WEIGHT_GRAPHS says why)
            weights = _CachedWeights(prepare_weights(params, mode) if graphed is None else graphed)
            weights.graphed = graphed is not None
        cached = self._weights_cache[mode] = (version, weights, held)
        return weights, True

    def _fused_inputs(self, pair_repr, pair_mask):
        """pair_repr with channel stride 1 and a mask the kernels read (a copy or conversion only where needed)."""
        if pair_repr.stride(-1) != 1:
            pair_repr = pair_repr.contiguous()
        if pair_mask.dtype not in _FUSED_MASK_DTYPES:
            pair_mask = pair_mask.to(torch.float32)
        return pair_repr, pair_mask

    def _option_values(self, mode: str):
        return (mode, self.direction == "incoming", self.gate_input == "normalized", self.layer_norm_in.eps,
                self.layer_norm_out.eps, self.hidden_dim)

    def _forward_fused(self, pair_repr, pair_mask, mode, kernels):
        original = (pair_repr, pair_mask)
        pair_repr, pair_mask = self._fused_inputs(pair_repr, pair_mask)
        values = self._option_values(mode)
        if torch.compiler.is_compiling():
            weights = prepare_weights(_param_list(self), mode)
            return fused_forward(pair_repr, pair_mask, weights, *(name or "" for name in kernels[:3]), *values)
        # Eager: skip the dispatcher (its overhead is most of a small call) and reuse weights.
        weights = self._prepared_weights(mode)
        options = _forward_options(kernels, *values)
        planned = []  # (the call's forward_plan, made at most once and only where asked for)

        def plan():
            if not planned:
                planned.append(_extension().forward_plan(pair_repr, pair_mask, weights, options))
            return planned[0]
        try:
            if not _fused_buffers_fit(pair_repr, plan):
                split = _split_forward(self, pair_repr, pair_mask, mode, kernels, weights, options)
                return split if split is not None else self.forward_chunked(*original)  # (memory-bounded)
            gate_weights = self._inference_gate_weights(pair_repr, pair_mask, mode, kernels, weights, plan)
            with _bmm_precision(kernels, mode):
                out = _extension().forward(pair_repr, pair_mask, weights, options, gate_weights)
        except NotImplementedError:  # nothing of a default order takes this call: the unfused path
            return self._forward_unfused(*original)
        if (not torch.is_grad_enabled() and not _is_torch_kernel("contract", kernels.contract)
                and pair_repr is original[0] and pair_mask is original[1]
                and pair_repr.numel() // pair_repr.shape[-1] <= _CHUNK_CHECK_POSITIONS):  # (larger: memory per call)
            # This signature passed check_inputs and needs no copy or conversion: plan it.
            extension = _extension()
            self._plans[self._plan_key(pair_repr, pair_mask)] = (mode, kernels, options, extension,
                                                                 gate_weights is not None)
            fast = self._fast_plan(pair_repr, pair_mask, self.resolved_precision(), weights, options, gate_weights)
            self._fast = None if fast is None else (extension, fast, _OPTIMIZER_STEPS[0])
        return out

    def forward_steps(self, pair_repr: torch.Tensor, pair_mask: torch.Tensor) -> ForwardSteps:
        """The fused forward of this call as its three steps on caller-provided buffers (ForwardSteps):
        the same checks, precision and kernel choice as a call; a ValueError where the call would not
        take the fused kernels (CPU, float64, sizes they do not take)."""
        check_inputs(self, pair_repr, pair_mask)
        if not _kernels_take(pair_repr):
            raise ValueError(f"trimul_inline: the fused steps take CUDA float32/bfloat16/float16 inputs on a GPU "
                             f"of compute capability {'.'.join(map(str, MIN_COMPUTE_CAPABILITY))} or newer, not "
                             f"{pair_repr.device} {pair_repr.dtype}")
        mode = compute_mode(pair_repr.dtype, self.resolved_precision())
        kernels = _with_override(self.kernels)
        pair_repr, pair_mask = self._fused_inputs(pair_repr, pair_mask)
        try:
            return ForwardSteps(pair_repr, pair_mask, self._prepared_weights(mode),
                                _forward_options(kernels, *self._option_values(mode)), mode)
        except NotImplementedError as error:
            raise ValueError(f"trimul_inline: the fused kernels do not take this call ({error})") from error

    def _x_hat_gate_weights(self, weights):
        """The prepared weights with out_gate folded with LayerNorm_in's affine (_x_hat_gate_weights, kept beside
        `weights` once made: the parameter list is only built to make them)."""
        folded = getattr(weights, "x_hat_gate", None)
        if folded is not None:
            return folded
        return _x_hat_gate_weights(weights, _with_zero_biases(_param_list_eager(self)))

    def _inference_gate_weights(self, pair_repr, pair_mask, mode, kernels, weights, plan):
        """The folded gate weights where the inference forward gates on x_hat (forward_plan's
        "inference_gate_rows", asked once per call signature; see the extension's gate_rows_plan: at pair_dim 384
        the normalized gate's output pass is the slower kernel), else None; None too where x_hat's [B*N*N, C] bf16
        would not fit beside the fused buffers. plan: the call's forward_plan (a callable that makes it once)."""
        if self.gate_input != "normalized" or mode != "bf16" or kernels.output:
            return None
        extension, key = _extension(), self._plan_key(pair_repr, pair_mask)
        choice = self._gate_choices.get(key)
        if choice is None or choice[0] is not extension:
            choice = self._gate_choices[key] = (extension, plan()["inference_gate_rows"])
        if not choice[1] or not _fused_buffers_fit(pair_repr, plan, x_hat=True):
            return None
        return self._x_hat_gate_weights(weights)

    def _fast_plan(self, pair_repr, pair_mask, precision, weights, options, gate_weights=None):
        """The C++ side of the planned path (the extension's PlannedForward): the signature and
        what _plan_key and the weights' freshness read, compared without Python per call. None
        under autocast or with parameters outside the modules' own dicts (parametrizations)."""
        if torch.is_autocast_enabled("cuda") or self.__dict__.get("_source") is not None:
            return None
        modules = self._modules
        entries = [(modules, name, modules[name]) for name in _SUBMODULES]
        params = []
        for module, name in _PARAM_PATHS:
            owner = modules[module]._parameters
            if name not in owner:
                return None
            param = owner[name]  # (None: a Linear without bias, checked to stay so)
            entries.append((owner, name, param))
            if param is not None:
                params.append(param)
        attributes = [(None, name, getattr(self, name)) for name in ("kernels", "direction", "gate_input")]
        attributes += [(modules[name], "eps", modules[name].eps) for name in ("layer_norm_in", "layer_norm_out")]
        return _extension().PlannedForward(entries, attributes, params, pair_repr, pair_mask, precision, weights,
                                           options, gate_weights)

    def _forward_sharded(self, pair_repr, pair_mask):
        """This rank's rows of the update (process_group): the per-position layers on its rows, the contraction
        across ranks (_ShardedContraction)."""
        shaped = isinstance(pair_repr, torch.Tensor) and pair_repr.dim() == 4
        ring = _Ring(self.process_group, pair_repr.shape[2] if shaped else 0,
                     pair_repr.device if shaped else torch.device("cpu"))
        ring.exchange = self.shard_exchange or shard_exchange_for(self.direction, ring.world)
        _check_sharded_inputs(self, ring, pair_repr, pair_mask)
        if not self._needs_autograd(pair_repr, pair_mask):
            return self._sharded_inference(pair_repr, pair_mask, ring)
        params = _param_list(self)
        with _float32_matmul_precision(self.resolved_precision()):
            if self._sharded_recomputes():
                out = self._sharded_trained(pair_repr, pair_mask, ring)
                if out is not None:
                    return out
                return self._sharded_by_row_steps(pair_repr, pair_mask, params, ring)
            x, a, b = _layers_in(params, pair_repr, pair_mask, self.layer_norm_in.eps, cast_mask=True)
            # planes [B, H, N_r, N] of this rank's rows (incoming: rows are the contracted index k)
            z = _ShardedContraction.apply(a.permute(0, 3, 1, 2).contiguous(), b.permute(0, 3, 1, 2).contiguous(),
                                          ring, self.direction == "incoming").permute(0, 2, 3, 1)
            out = _layers_out(params, z, pair_repr if self.gate_input == "raw" else x, self.layer_norm_out.eps)
            return out.to(pair_repr.dtype)  # (under autocast: the layers' bf16, the fused path's dtype instead)

    def _sharded_recomputes(self) -> bool:
        """Whether the sharded training forward recomputes its per-position layers in the backward
        (_sharded_by_row_steps): unless backward_saves is "z" (keep their autograd's intermediates, ~20 pair
        blocks), since recomputing measured faster as well as smaller (bench/NOTES.md)."""
        return self.backward_saves != "z"

    def _sharded_trained(self, pair_repr, pair_mask, ring):
        """_forward_sharded's training forward on the fused passes, its backward on the backward roles' kernels for
        this rank's block of rows (_ShardedTraining: z's rows and the exchange's operands kept, nothing else), where
        they take the call: bf16 operands (bf16 inputs, "medium", or bf16 autocast), the row-block passes
        (_row_block_steps), and output_backward and input_backward kernels that take a block of rows; else None
        (the PyTorch layers by row steps). Eager calls only (torch.compile traces the row steps)."""
        if torch.compiler.is_compiling() or not pair_repr.is_cuda or \
                compute_mode(pair_repr.dtype, self.resolved_precision()) != "bf16":
            return None
        pair_repr, pair_mask = self._fused_inputs(pair_repr, pair_mask)
        kernels = _with_override(self.kernels)
        if not self._block_backward_takes(pair_repr, kernels):  # (the cheap question before the steps' plan)
            return None
        with torch.autocast("cuda", enabled=False):
            steps = self._row_block_steps(pair_repr, pair_mask, "bf16")
            if steps is None:
                return None
            options = (kernels, self.gate_input == "normalized", self.layer_norm_in.eps, self.layer_norm_out.eps)
            return _ShardedTraining.apply(pair_repr, pair_mask, steps, ring, self.direction == "incoming", options,
                                          *_param_list(self))

    def _block_backward_takes(self, pair_repr, kernels) -> bool:
        """Whether output_backward's and input_backward's kernels (named, else the default order's) take this
        rank's block of rows [B, N_r, N, C] with bf16 operands (the torch baselines take none). An empty block
        (N < world) takes none: BackwardArgs::block_rows reads 0 rows as N (square planes), so it is not asked."""
        batch, rows, n, pair_dim = pair_repr.shape
        if rows == 0:
            return False
        like = pair_repr.new_empty(0, dtype=torch.bfloat16)
        try:
            return all(_backward_kernel(role, getattr(kernels, role), batch, n, pair_dim, self.hidden_dim, False,
                                        like, "bf16", rows) for role in ("output_backward", "input_backward"))
        except (ValueError, NotImplementedError):  # (a kernel named for the role that does not take it)
            return False

    def _sharded_by_row_steps(self, pair_repr, pair_mask, params, ring):
        """_forward_sharded's training forward with its per-position layers a few rows at a time
        (_sharded_steps) under activation checkpointing: a step keeps its inputs only (views of pair_repr, the
        mask and z) and recomputes its layers in the backward, so the rank holds the planes, z and the output
        instead of the layers' intermediates for all its rows. The steps' pieces are split from and joined into
        whole tensors (split / cat: one gradient buffer each in the backward, not one per step)."""
        from torch.utils.checkpoint import checkpoint
        sizes = [step.stop - step.start for step in _sharded_steps(pair_repr, self.hidden_dim, share=2)] or [0]
        pairs, masks = pair_repr.split(sizes, 1), pair_mask.split(sizes, 1)
        eps_in, eps_out, raw = self.layer_norm_in.eps, self.layer_norm_out.eps, self.gate_input == "raw"
        precision = torch.get_float32_matmul_precision()  # (the layer's: the backward's recompute runs outside it)

        def planes(pair, mask, *params):  # (a and b as contiguous [B, H, rows, N]: so are the planes they join)
            with _float32_matmul_precision(precision):
                _, a, b = _layers_in(params, pair, mask, eps_in, cast_mask=True)
            return a.permute(0, 3, 1, 2).contiguous(), b.permute(0, 3, 1, 2).contiguous()

        def out_rows(z_rows, pair, *params):
            with _float32_matmul_precision(precision):
                gate_source = pair if raw else _layer_norm_in(params, pair, eps_in)
                return _layers_out(params, z_rows.permute(0, 2, 3, 1), gate_source, eps_out)
        sides = [checkpoint(planes, pair, mask, *params, use_reentrant=False) for pair, mask in zip(pairs, masks)]
        a_t, b_t = (torch.cat([side[i] for side in sides], 2) for i in range(2))
        del sides
        z = _ShardedContraction.apply(a_t, b_t, ring, self.direction == "incoming")
        del a_t, b_t
        out = torch.cat([checkpoint(out_rows, z_rows, pair, *params, use_reentrant=False)
                         for z_rows, pair in zip(z.split(sizes, 2), pairs)], 1)
        return out.to(pair_repr.dtype)  # (under autocast: the layers' bf16, the fused path's dtype instead)

    def _sharded_inference(self, pair_repr, pair_mask, ring):
        """_forward_sharded with no gradient needed: on the fused passes where they take this rank's rows
        (_row_block_steps, _sharded_fused); else the a / b planes [B, H, N_r, N] filled a few rows at a time
        (_gated_side, in the chunked forward's operand dtype), the contraction across ranks, then the output
        layers a few rows at a time into the output, so the rank holds its planes, z and the output plus one
        step's temporaries (_sharded_steps), not the layers' whole intermediates."""
        batch, rows, n, _ = pair_repr.shape
        hidden, incoming = self.hidden_dim, self.direction == "incoming"
        mode = compute_mode(pair_repr.dtype, self.resolved_precision())
        operand = _chunk_operand(pair_repr.dtype, mode)
        with torch.no_grad(), torch.autocast(pair_repr.device.type, enabled=False), \
                _float32_matmul_precision(_MODE_PRECISION.get(mode, "highest")):
            fused = self._row_block_steps(pair_repr, pair_mask, mode)
            if fused is not None:
                return _sharded_fused(fused, ring, incoming)[0]
            params, layer_norm = _layers_in_dtype(self, pair_repr.dtype)
            eps_out = self.layer_norm_out.eps
            steps = _sharded_steps(pair_repr, hidden)
            a_t, b_t = (pair_repr.new_empty((batch, hidden, rows, n), dtype=operand) for _ in range(2))
            for part in steps:
                x = layer_norm(pair_repr[:, part])
                for side, planes in enumerate((a_t, b_t)):
                    planes[:, :, part] = _gated_side(params, x, pair_mask[:, part], side, operand).permute(0, 3, 1, 2)
                del x
            planes = [a_t, b_t]
            del a_t, b_t  # (the exchange frees them as soon as it can: planes holds the only references)
            z = _rows_z(planes, ring, incoming)  # [B, H, N_r, N]
            out = torch.empty_like(pair_repr, memory_format=torch.contiguous_format)
            for part in steps:
                source = pair_repr[:, part]
                gate_source = source if self.gate_input == "raw" else layer_norm(source)
                out[:, part] = _layers_out(params, z[:, :, part].permute(0, 2, 3, 1).to(pair_repr.dtype), gate_source,
                                           eps_out)
            return out

    def _row_block_steps(self, pair_repr, pair_mask, mode) -> Optional[ForwardSteps]:
        """The fused input and output passes on this rank's block of rows [B, N_r, N, C] (planes in the outgoing
        layout whatever the direction: the exchange gives the contraction its direction), where kernels of the
        default order take row blocks and the plan's planes are the exchange's [B, H, N_r, N] as they are (no
        padding: N a multiple of 32, z in the operands' dtype); else None (the PyTorch layers): an empty block, or
        kernels named for the input or output role that do not take a block (the PyTorch layers ignore them, as
        the sharded path always has)."""
        if not _kernels_take(pair_repr) or pair_repr.shape[1] == 0:
            return None
        kernels = _with_override(self.kernels)
        pair_repr, pair_mask = self._fused_inputs(pair_repr, pair_mask)
        values = list(self._option_values(mode))
        values[1] = False  # (the outgoing layout)
        try:
            steps = ForwardSteps(pair_repr, pair_mask, self._prepared_weights(mode),
                                 _forward_options((kernels.input, None, kernels.output), *values), mode)
        except (NotImplementedError, ValueError):  # (no kernel of the default order, or a named one, takes it)
            return None
        batch, rows, n, _ = pair_repr.shape
        plan = steps.plan
        planes = [2, batch * self.hidden_dim, rows, n]
        if list(plan["ab_shape"]) != planes or plan["z_shape"] is None or \
                list(plan["z_shape"]) != planes[1:] or plan["z_dtype"] != plan["ab_dtype"]:
            return None
        return steps

    def _forward_unfused(self, pair_repr, pair_mask):
        """PyTorch layers around the `contract` op (its kernels, its backward): sizes the fused passes do not
        take."""
        params = _param_list(self)
        batch, n = pair_repr.shape[:2]
        x, a, b = _layers_in(params, pair_repr, pair_mask, self.layer_norm_in.eps, cast_mask=True)
        kernel = _with_override(self.kernels).contract or ""
        z = contract(_contraction_layout(a, self.direction), _contraction_layout(b, self.direction),
                     kernel, self.resolved_precision())
        z = z.view(batch, self.hidden_dim, n, n).permute(0, 2, 3, 1)
        out = _layers_out(params, z, pair_repr if self.gate_input == "raw" else x, self.layer_norm_out.eps)
        return out.to(pair_repr.dtype)  # (under autocast the layers give bf16: the fused path's dtype instead)


# ------------------------------------------------------------------------------------------------
# Long sequences (inference): the forward in chunks of rows
# ------------------------------------------------------------------------------------------------
def _chunk_operand(pair_dtype: torch.dtype, mode: str) -> torch.dtype:
    """The chunked forward's contraction operands: the pair's dtype for 16-bit and float64 pairs; for fp32, bf16
    ("medium"), fp16 (fp16 autocast) or fp32 ("high", "highest": TF32 / fp32 products)."""
    if pair_dtype in (torch.bfloat16, torch.float16, torch.float64):
        return pair_dtype
    return {"bf16": torch.bfloat16, "f16": torch.float16}.get(mode, torch.float32)


def _free_bytes(device: torch.device) -> int:
    """Bytes the caching allocator can hand out on `device` without the GPU running out: free on the device
    plus what the allocator holds unused."""
    free = torch.cuda.mem_get_info(device)[0]
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


_CHUNK_CHECK_POSITIONS = 1 << 22  # smaller problems never chunk by themselves (and skip the memory query)


def _plan_bytes(plan: dict, buffer: str) -> int:
    """The bytes of a forward_plan's buffer ("ab" or "z": its "<buffer>_shape" of "<buffer>_dtype")."""
    return math.prod(plan[f"{buffer}_shape"]) * getattr(torch, plan[f"{buffer}_dtype"]).itemsize


def _fused_peak_bytes(plan: dict, pair: torch.Tensor, x_hat: bool = False) -> int:
    """The fused one-call forward's buffers at their peak, from its plan (the extension's forward_plan): a/b, then
    z beside them, a/b freed before the output (z + max(a/b, out)); where the output pass contracts (no z) a/b
    and the output together. x_hat: LayerNorm_in's bf16 rows [B*N*N, C] beside all of them (the gate on x_hat)."""
    ab, out = _plan_bytes(plan, "ab"), pair.numel() * pair.element_size()
    peak = ab + out if plan["z_shape"] is None else _plan_bytes(plan, "z") + max(ab, out)
    return peak + (2 * pair.numel() if x_hat else 0)


def _fused_buffers_fit(pair: torch.Tensor, plan: Callable[[], dict], x_hat: bool = False) -> bool:
    """Whether the fused forward's buffers (_fused_peak_bytes of plan(), asked only past _CHUNK_CHECK_POSITIONS
    positions: smaller problems are taken to fit) fit in the free GPU memory, with 5 % to spare."""
    batch, n = pair.shape[:2]
    if not pair.is_cuda or batch * n * n <= _CHUNK_CHECK_POSITIONS or torch.compiler.is_compiling():
        return True
    return _fused_peak_bytes(plan(), pair, x_hat) * 1.05 <= _free_bytes(pair.device)


# The split forward: where the one fused call's buffers do not fit, the same kernels on a part of the call at a
# time, before the chunked forward (~6x slower at large N: its unfused layers). A part is one batch element (its
# z and a/b a B-th of the call's), or one group of an element's hidden channels: the group's input pass writes
# a/b of its channels only (a layer of hidden H / groups whose projections are rows of this one's: the same
# kernels, the same products per channel) and its contraction z's planes of them (at B = 1 a group's planes are
# a slice of z), then one output pass reads the whole z. Each group beyond the first reads the pair once more.
_SPLIT_GROUPS = (1, 2, 4, 8)  # (hidden-channel groups per element, fewest first: each more costs a read of the pair)
_CHANNEL_ROWS = slice(2, 10)  # (_PARAM_PATHS of proj_a .. gate_b: their output rows are hidden channels)


def _channel_group_params(params, first: int, count: int) -> list:
    """The 16 parameters of the layer computing hidden channels [first, first + count) of `params`' layer: the
    four projections' rows, LayerNorm_out's entries and out_proj's columns of those channels (its output side
    is consistent, though a group's steps use only its input side)."""
    group = list(params)
    for i in range(_CHANNEL_ROWS.start, _CHANNEL_ROWS.stop):
        group[i] = None if params[i] is None else params[i][first:first + count]
    group[10], group[11] = params[10][first:first + count], params[11][first:first + count]
    group[12] = params[12][:, first:first + count]
    return group


def _split_peak_bytes(batch: int, element: "ForwardSteps", group: "ForwardSteps") -> int:
    """The split forward's buffers at their peak: one element's z and one group's a/b (reused by every group),
    then, at B = 1, the output in a/b's place; at B > 1 the whole output throughout (each element's written in
    place)."""
    z, ab = _plan_bytes(element.plan, "z"), _plan_bytes(group.plan, "ab")
    out = element._call[0].numel() * element._call[0].element_size()
    return z + max(ab, out) if batch == 1 else batch * out + z + ab


def _channel_group(layers, mode: str, kernels, first: int, count: int) -> tuple:
    """(prepared weights, forward options) of the layer's hidden channels [first, first + count)."""
    values = layers._option_values(mode)[:-1]  # (all but hidden_dim: the group's is `count`)
    return (prepare_weights(_channel_group_params(_param_list_eager(layers), first, count), mode),
            _forward_options(kernels, *values, count))


def _channel_groups(layers, mode: str, kernels, weights, options, groups: int, first=None) -> list:
    """_channel_group of each of `groups` equal groups of the layer's hidden channels (one group: the layer's own
    weights and options); first: the first group's, where already made."""
    if groups == 1:
        return [(weights, options)]
    count = layers.hidden_dim // groups
    if first is None:
        first = _channel_group(layers, mode, kernels, 0, count)
    return [first] + [_channel_group(layers, mode, kernels, g * count, count) for g in range(1, groups)]


def _split_forward(layers, pair, mask, mode, kernels, weights, options) -> Optional[torch.Tensor]:
    """The fused forward a part at a time (see _SPLIT_GROUPS): the fewest hidden-channel groups (each batch
    element alone) whose peak (_split_peak_bytes) fits in the free memory with 5 % to spare; None where none
    does, or where the plan has no z to split (the output pass contracts)."""
    batch, hidden, size = pair.shape[0], layers.hidden_dim, pair.element_size()
    if batch > 1 and (pair.stride(0) * size % 16 or pair[0].numel() * size % 16):
        return None  # (each element's pair and output would not start 16-byte aligned, as a step's buffers do)
    element = ForwardSteps(pair[:1], mask[:1], weights, options, mode)
    if element.plan["z_shape"] is None:
        return None
    free = _free_bytes(pair.device)
    for groups in _SPLIT_GROUPS:
        count = hidden // groups
        if (batch == 1 and groups == 1) or hidden % groups or count % 8:
            continue
        # (the first group decides the fit: the others are prepared only for the split that runs)
        part = (weights, options) if groups == 1 else _channel_group(layers, mode, kernels, 0, count)
        first = ForwardSteps(pair[:1], mask[:1], *part, mode)
        if list(first.plan["z_shape"]) != [count, *element.plan["z_shape"][1:]] or \
                first.plan["z_dtype"] != element.plan["z_dtype"]:
            continue  # (a group's z planes would not be a slice of the element's)
        if _split_peak_bytes(batch, element, first) * 1.05 <= free:
            parts = _channel_groups(layers, mode, kernels, weights, options, groups, part)
            return _run_split(pair, mask, mode, weights, options, parts)
    return None


def _run_split(pair, mask, mode, weights, options, groups) -> torch.Tensor:
    """Each batch element: each channel group's ((weights, options) of _channel_groups) input pass and
    contraction into its slice of the element's z (one a/b buffer for all groups), then the element's output
    pass on the whole z, into its part of the output (each element's 16-byte aligned: _split_forward's check)."""
    batch = pair.shape[0]
    out = None if batch == 1 else torch.empty_like(pair, memory_format=torch.contiguous_format)
    for b in range(batch):
        element = ForwardSteps(pair[b:b + 1], mask[b:b + 1], weights, options, mode)
        z, ab = element.new_z(), None
        for g, (group_weights, group_options) in enumerate(groups):
            steps = ForwardSteps(pair[b:b + 1], mask[b:b + 1], group_weights, group_options, mode)
            count = steps.plan["z_shape"][0]
            ab = steps.new_ab() if ab is None else ab
            steps.input_pass(ab)
            steps.contraction(ab, z[g * count:(g + 1) * count])
        del ab  # (before the output: at B = 1 it takes a/b's place)
        if out is None:
            out = element.new_out()
        element.output_pass(out if batch == 1 else out[b:b + 1], z=z)
        del z
    return out


class _ChunkPlan(NamedTuple):
    """The chunked forward's sizes: output rows (incoming: columns) per chunk, whose side of the projection is
    kept as planes [B, H, rows, N]; positions of the whole side per block multiplied against a chunk (the
    z block and the output layers run on rows x cols positions); input rows per step while a side is filled."""
    rows: int
    cols: int
    fill: int


_SIDE_SHARE = 16  # the chunked forward's temporaries: a 1/_SIDE_SHARE part of the whole side's bytes


def _chunk_plan(pair: torch.Tensor, hidden: int, operand: torch.dtype, whole_bytes: int,
                chunk_size: Optional[int]) -> _ChunkPlan:
    """The chunked forward's temporaries within a budget, a sixteenth of the whole side's bytes (at least 1 GiB)
    and at most a quarter of the free memory (1 GiB off CUDA): half for the chunk's planes (chunk_size rows where
    given, which then bounds the fill steps too), half for the step in hand: filling (LayerNorm_in's rows and one
    side's projections, about C + 3 H values per position in the pair's dtype) or one block (z, LayerNorm_out and
    the output layers, about 4 C + 8 H). Large chunks read the whole side fewer times: it is read once per chunk."""
    batch, n, _, c = pair.shape
    size = pair.element_size()
    budget = min(_free_bytes(pair.device) // 4, max(whole_bytes // _SIDE_SHARE, 1 << 30)) if pair.is_cuda else 1 << 30
    half = budget // 2
    rows = chunk_size or half // (batch * n * hidden * operand.itemsize)
    rows = max(1, min(n, rows))
    fill = max(1, min(n, chunk_size or n, half // (batch * n * (c + 3 * hidden) * size)))
    cols = max(1, min(n, half // (batch * rows * (4 * c + 8 * hidden) * size)))
    return _ChunkPlan(rows, cols, fill)


def _spans(size: int, start: int, stop: int) -> list:
    """Consecutive slices of at most `size` covering start .. stop."""
    return [slice(s, min(s + size, stop)) for s in range(start, stop, size)]


def _block_product_channels(hidden: int) -> list:
    """The hidden-channel slices a sharded outgoing block product runs one at a time (a quarter each): the
    product's temporary is a quarter of an N_r x N_s x H block, which keeps the per-rank peak near 1/P."""
    return _spans(max(1, -(-hidden // 4)), 0, hidden)


def _layers_in_dtype(layers, dtype: torch.dtype):
    """(the layers' parameters in `dtype`, _PARAM_PATHS order; LayerNorm_in with them): what the no-gradient
    forwards built of PyTorch layers (chunked, sharded) run on."""
    params = [None if p is None else p.to(dtype) for p in _param_list(layers)]
    eps_in = layers.layer_norm_in.eps
    return params, lambda rows: _layer_norm_in(params, rows, eps_in)


def _gated_side(params, x, mask, side: int, operand: torch.dtype):
    """One side of the gated projection, proj(x) * sigmoid(gate(x)) * mask ([B, rows, cols, H]; side 0: a,
    1: b), in `operand`; in-place steps, so a chunk's peak is x plus two [.., H] tensors."""
    proj_w, proj_b, gate_w, gate_b = params[2 + 4 * side:6 + 4 * side]
    linear = torch.nn.functional.linear
    p = linear(x, proj_w, proj_b)
    gate = linear(x, gate_w, gate_b).sigmoid_()
    p.mul_(gate)
    del gate
    return p.mul_(mask.unsqueeze(-1).to(p.dtype)).to(operand)


_IN_PLACE_LEAST_BUDGET = 1 << 28  # bytes: smaller temporaries would make blocks too thin to multiply well


class _InPlacePlan(NamedTuple):
    """The in-place update's sizes (_chunked_update), in lines of pair_repr (rows outgoing, columns incoming):
    the first chunks, whose side is saved (`first` lines each, while more than `last` lines are left), then
    the last lines `rows` at a time; `cols` whole-side lines per block, the output layers on at most
    `positions` positions at a time, `fill` input lines per fill step."""
    first: int
    last: int
    rows: int
    cols: int
    positions: int
    fill: int


def _check_chunked_out(pair: torch.Tensor, out, add: bool) -> None:
    """forward_chunked's out: None (a new tensor; then add has nothing to add to), a tensor like pair_repr apart
    from it, or pair_repr itself (the same view: in place); a view that overlaps pair_repr otherwise would be
    read after it was written."""
    if out is None:
        if add:
            raise ValueError("trimul_inline: add=True adds the update into out; pass out (update_ adds into pair_repr)")
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"trimul_inline: out must be a tensor or None, got {type(out).__name__}")
    if out.shape != pair.shape or out.dtype != pair.dtype or out.device != pair.device:
        raise ValueError(f"trimul_inline: out must be like pair_repr ({tuple(pair.shape)}, {pair.dtype}, "
                         f"{pair.device}), got {tuple(out.shape)}, {out.dtype}, {out.device}")
    same_view = out.data_ptr() == pair.data_ptr() and out.stride() == pair.stride()
    if not same_view and out.numel() and out.untyped_storage().data_ptr() == pair.untyped_storage().data_ptr():
        if _ranges_overlap(out, pair):
            raise ValueError("trimul_inline: out overlaps pair_repr without being it (another view of its "
                             "memory); pass pair_repr itself for an in-place update, or a separate tensor")


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from t's first element to one past its last (strides non-negative)."""
    return (sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1) * t.element_size()


def _ranges_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() < b.data_ptr() + _span_bytes(b) and b.data_ptr() < a.data_ptr() + _span_bytes(a)


def _in_place_plan(pair: torch.Tensor, hidden: int, operand: torch.dtype, chunk_size: Optional[int]) -> _InPlacePlan:
    """Sizes that keep the in-place update within the pair's bytes at H <= C (DESIGN.md "Long sequences"): a
    temporary budget T of a sixteenth of one side (at least _IN_PLACE_LEAST_BUDGET, at most a quarter of the free
    memory); the first chunk 0.45 N lines (its side and its saved whole-side lines: 0.9 N + T); then the last
    0.55 N lines N / 16 at a time (the saved lines 0.45 N + the held updates ~0.25 N + a chunk + T; then their own
    whole side 0.55 N + the held updates + a chunk + T). Within T: a block made from raw lines and its z
    ([B, H, chunk, cols]), then z and the output layers' temporaries (about 4 C + 8 H values per position)."""
    batch, n, _, c = pair.shape
    size, line = pair.element_size(), batch * n * hidden * operand.itemsize
    budget = max(line * n // _SIDE_SHARE, _IN_PLACE_LEAST_BUDGET)
    if pair.is_cuda:
        budget = min(budget, _free_bytes(pair.device) // 4)
    # (a chunk_size asked for is taken where it is smaller than the plan's: larger chunks would hold more lines'
    # sides at once than the pair's bytes allow)
    stage = max(1, n * 9 // 20)  # (the first stage's lines; the last n - stage go `rows` at a time)
    first = min(chunk_size or n, stage)
    rows = max(1, min(chunk_size or n, n // 16))
    chunk = max(first, rows)
    cols = max(1, min(n, budget // (2 * batch * hidden * operand.itemsize * (n + chunk))))
    z_bytes = batch * hidden * chunk * cols * operand.itemsize
    positions = max(1, (budget - z_bytes) // (batch * (4 * c + 8 * hidden) * size))
    fill = max(1, min(n, chunk_size or n, budget // 2 // (batch * n * (c + 3 * hidden) * size)))
    return _InPlacePlan(first, n - stage, rows, cols, positions, fill)


def _chunked_update(layers, pair, mask, operand, mode, chunk_size, out, add, lean=None):
    """ModelNew.forward_chunked's work (no autograd). One side is needed whole by every output chunk: b
    (outgoing, plane[j, k] = b[j, k]: pair_repr's row j) or a (incoming, plane[i, k] = a[k, i]: its column i),
    as planes [B, H, lines, N] in `operand` -- the whole side; the other side per chunk of output lines (rows i
    outgoing, columns j incoming), as planes [B, H, chunk, N]; z per block of whole-side lines (torch.matmul:
    cuBLAS at the mode's precision) and the output layers on those positions. Into a separate `out` the whole
    side is made first (_chunk_plan sizes the rest), and in place too unless `lean` (None: unless the whole
    side and its plan's budget do not fit in the free memory), where _in_place_update keeps the update within
    the pair's bytes."""
    batch, n = pair.shape[:2]
    hidden, incoming = layers.hidden_dim, layers.direction == "incoming"
    params, layer_norm = _layers_in_dtype(layers, pair.dtype)
    eps_out = layers.layer_norm_out.eps
    whole_side, chunk_side = (0, 1) if incoming else (1, 0)

    def fill(planes, part, offset, side, from_columns, into_columns, step):
        """That side of pair_repr's rows (from_columns: columns) `part`, `step` lines at a time, into the planes
        [B, H, ., .]: into their rows part - offset, or their columns (into_columns)."""
        for piece in _spans(step, part.start, part.stop):
            where = (slice(None), slice(None), piece) if from_columns else (slice(None), piece)
            values = _gated_side(params, layer_norm(pair[where]), mask[where], side, operand)  # [B, ., ., H]
            values = values.permute(0, 3, 2, 1) if from_columns != into_columns else values.permute(0, 3, 1, 2)
            target = slice(piece.start - offset, piece.stop - offset)
            planes[(..., target) if into_columns else (slice(None), slice(None), target)] = values

    def lines(part, side, step):
        """That side for pair_repr's lines `part` (rows outgoing, columns incoming): planes [B, H, part, N]."""
        planes = pair.new_empty((batch, hidden, part.stop - part.start, n), dtype=operand)
        fill(planes, part, part.start, side, incoming, False, step)
        return planes

    def updates(side, chunk, blocks, positions=None):
        """(positions, update) for the chunk's lines against each (whole-side lines, their planes) of blocks;
        the output layers on at most `positions` positions at a time (None: a block at once)."""
        for block, whole in blocks:
            if incoming:  # z[i, j] = sum_k a[k, i] b[k, j]: [B, H, block (i), chunk (j)]
                z, rows, cols = torch.matmul(whole, side.transpose(-1, -2)), block, chunk
            else:  # z[i, j] = sum_k a[i, k] b[j, k]: [B, H, chunk (i), block (j)]
                z, rows, cols = torch.matmul(side, whole.transpose(-1, -2)), chunk, block
            del whole  # (a block made for this product is freed before the next is made)
            z = z.permute(0, 2, 3, 1)  # [B, rows, cols, H]
            step = rows.stop - rows.start if positions is None else max(1, positions // (cols.stop - cols.start))
            for part in _spans(step, rows.start, rows.stop):
                index = (slice(None), part, cols)
                source = pair[index]
                gate_source = source if layers.gate_input == "raw" else layer_norm(source)
                z_part = z[:, part.start - rows.start:part.stop - rows.start].to(pair.dtype)
                update = _layers_out(params, z_part, gate_source, eps_out)
                del z_part, source, gate_source
                yield index, update
                del update

    def write(index, update):
        if add:
            out[index] += update
        else:
            out[index] = update

    with _float32_matmul_precision(_MODE_PRECISION.get(mode, "highest")):
        in_place = out is not None and out.data_ptr() == pair.data_ptr()
        if in_place and (lean or lean is None and not _whole_side_fits(pair, hidden, operand)):
            return _in_place_update(pair, hidden, operand, chunk_size, lines, updates, write, whole_side,
                                    chunk_side)
        whole = pair.new_empty((batch, hidden, n, n), dtype=operand)
        plan = _chunk_plan(pair, hidden, operand, whole.numel() * whole.element_size(), chunk_size)
        # (incoming: a[k, i] from pair_repr's rows k, into the planes' columns: contiguous reads)
        fill(whole, slice(0, n), 0, whole_side, False, incoming, plan.fill)
        out = torch.empty_like(pair, memory_format=torch.contiguous_format) if out is None else out
        for chunk in _spans(plan.rows, 0, n):
            side = lines(chunk, chunk_side, plan.fill)
            for index, update in updates(side, chunk, _blocks(plan.cols, [(slice(0, n), whole)])):
                write(index, update)
            del side
    return out


def _whole_side_fits(pair: torch.Tensor, hidden: int, operand: torch.dtype) -> bool:
    """Whether the whole side's planes and _chunk_plan's budget (a sixteenth of them) fit in the free memory
    (off CUDA: taken to fit)."""
    if not pair.is_cuda:
        return True
    whole = pair.shape[0] * hidden * pair.shape[1] ** 2 * operand.itemsize
    return whole + whole // _SIDE_SHARE <= _free_bytes(pair.device)


def _blocks(cols: int, pieces):
    """(lines, planes) per block of at most `cols` lines of each (lines, planes [B, H, lines, N]) piece."""
    for part, planes in pieces:
        for block in _spans(cols, part.start, part.stop):
            yield block, planes[:, :, block.start - part.start:block.stop - part.start]


def _in_place_update(pair, hidden, operand, chunk_size, lines, updates, write, whole_side, chunk_side):
    """_chunked_update into pair_repr itself. A line's update may be written once no later step needs its raw
    values: the whole side of a written line is saved first. Stage 1, chunks of the first lines: the chunk's
    side and its whole-side lines (saved), then its blocks against the saved lines, its own, and the lines still
    raw (their whole side made per block), written at once. Stage 2, the last lines L: their updates against the
    saved lines are held (L's raw values stay for their own whole side), the saved lines freed; then L's whole
    side, L's updates against it written, and the held ones. Peak: the saved lines + two chunks' sides + the
    temporaries, or the saved lines + the held updates (< |L| (N - |L|) positions) + a chunk (_in_place_plan)."""
    n = pair.shape[1]
    plan = _in_place_plan(pair, hidden, operand, chunk_size)

    def made(part):  # whole-side lines made per block from raw lines
        return ((block, lines(block, whole_side, plan.fill)) for block in _spans(plan.cols, part.start, part.stop))

    saved, start = [], 0
    while n - start > plan.last:
        chunk = slice(start, min(n, start + plan.first))
        side, own = lines(chunk, chunk_side, plan.fill), lines(chunk, whole_side, plan.fill)
        blocks = itertools.chain(_blocks(plan.cols, saved + [(chunk, own)]), made(slice(chunk.stop, n)))
        for index, update in updates(side, chunk, blocks, plan.positions):
            write(index, update)
        saved.append((chunk, own))
        start = chunk.stop
        del side, own
    last, held = slice(start, n), []
    for chunk in _spans(plan.rows, start, n):
        held.extend(updates(lines(chunk, chunk_side, plan.fill), chunk, _blocks(plan.cols, saved), plan.positions))
    saved.clear()
    own = lines(last, whole_side, plan.fill)
    for chunk in _spans(plan.rows, start, n):
        side = lines(chunk, chunk_side, plan.fill)
        for index, update in updates(side, chunk, _blocks(plan.cols, [(last, own)]), plan.positions):
            write(index, update)
        del side
    del own
    for index, update in held:
        write(index, update)
    return pair


# ------------------------------------------------------------------------------------------------
# Sharded over ranks (torch.distributed, DAP-style): each rank holds a block of pair_repr's rows
# ------------------------------------------------------------------------------------------------
def shard_rows(n: int, world: int, rank: int) -> range:
    """The rows of pair_repr rank `rank` of `world` holds: torch.tensor_split(torch.arange(n), world)[rank]."""
    if n < 0 or world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard_rows: needs N >= 0, world >= 1 and 0 <= rank < world; got N = {n}, world = "
                         f"{world}, rank = {rank}")
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


SHARD_EXCHANGES = ("ring", "channels")
P2P_OPS_PER_BATCH = 1024  # (messages per batch_isend_irecv: NCCL groups at most 2048 operations; tests set it low)


def shard_exchange_for(direction: str, world: int) -> str:
    """How the sharded contraction crosses ranks where none is named (bench/shard_model.py): the ring for outgoing
    on one or two ranks (b's one other block hides behind the own block's product and nothing goes back) and for
    incoming on one (no transfer at all); else the channel exchange (3 (P - 1) / P blocks sent per rank against
    the ring's P - 1 blocks of b, and incoming needs no all-to-all of a)."""
    return "channels" if world > 2 or (world == 2 and direction == "incoming") else "ring"


class _Ring:
    """A process group as the sharded contraction uses it: row counts per rank, the exchange it runs (`exchange`:
    "ring": b's row blocks round the ring; "channels": a and b to the owners of their hidden channels and z
    back, _channel_z), the ring's neighbours, and transfers staged through the CPU where the backend cannot move
    the tensors' device (gloo with CUDA)."""

    def __init__(self, group, n: int, device: torch.device, exchange: str = "ring"):
        import torch.distributed as dist
        self.dist, self.group, self.exchange = dist, group, exchange
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.columns = [slice(r.start, r.stop) for r in (shard_rows(n, self.world, s) for s in range(self.world))]
        self.counts = [c.stop - c.start for c in self.columns]
        self.stage = device.type == "cuda" and dist.get_backend(group) == "gloo"

    def start_exchange(self, units: list, bound: int, tag: int):
        """Point-to-point transfers started: units [(sends [(tensor, group rank)], receives [(destination, group
        rank)])], every tensor contiguous, the same number of units on every rank, each pair of ranks posting its
        messages in the same order on both sides (the k-th send from r to s lands in s's k-th receive from r).
        bound: the most messages (sends and receives) a unit has on any rank, the same number on every rank: the
        units go in batches of at most P2P_OPS_PER_BATCH messages, cut alike on every rank (NCCL aggregates at
        most 2048 operations in one group). Returns wait() (the destinations filled)."""
        per_batch = max(1, P2P_OPS_PER_BATCH // max(1, bound))
        requests, staged = [], []
        for first in range(0, len(units), per_batch):
            ops = []
            for sends, receives in units[first:first + per_batch]:
                for tensor, rank in sends:
                    ops.append(self.dist.P2POp(self.dist.isend, self._staged(tensor), self.peer(rank), self.group,
                                               tag))
                for target, rank in receives:
                    buffer = torch.empty(target.shape, dtype=target.dtype) if self.stage else target
                    ops.append(self.dist.P2POp(self.dist.irecv, buffer, self.peer(rank), self.group, tag))
                    if self.stage:
                        staged.append((target, buffer))
            if ops:  # (none here: none with this rank on any other either)
                requests += self.dist.batch_isend_irecv(ops)

        def wait():
            for request in requests:
                request.wait()
            requests.clear()
            for target, buffer in staged:
                target.copy_(buffer)
            staged.clear()
        return wait

    def peer(self, rank: int) -> int:
        """The global rank of group rank `rank` (P2P ops take global ranks)."""
        return self.dist.get_global_rank(self.group, rank % self.world)

    def _staged(self, tensor):
        return tensor.cpu() if self.stage else tensor

    def shift(self, block, incoming_rows: int, row_dim: int, step: int = 1):
        """Starts sending `block` to rank + step and receiving rank - step's (incoming_rows along row_dim);
        returns (wait() -> the received block). step -1: the other way round the ring."""
        shape = list(block.shape)
        shape[row_dim] = incoming_rows
        received = block.new_empty(shape)
        tag = 1 if step > 0 else 2  # (the two directions apart where a backend matches by tag)
        arrival = self.start_exchange([([(block.contiguous(), (self.rank + step) % self.world)],
                                        [(received, (self.rank - step) % self.world)])], 2, tag)

        def wait():
            arrival()
            return received
        return wait

    def all_to_all(self, chunks):
        """chunks[s] ([.., rows, cols]) to rank s; returns what each rank sent here, in rank order: from rank s a
        chunk of its rows and this rank's columns, so the last two sizes of chunks[s] swapped."""
        return self.start_all_to_all(chunks)()

    def start_all_to_all(self, chunks, keep_own: bool = True):
        """all_to_all started: returns (wait() -> the received chunks); this rank's own chunk is chunks[rank]
        and needs no waiting (keep_own False: None there, and wait() holds no reference to the chunks, so
        that their tensor can be freed while the transfers run). The sent copies are dropped once waited for."""
        received = [None if s == self.rank else chunks[0].new_empty(c.shape[:-2] + (c.shape[-1], c.shape[-2]))
                    for s, c in enumerate(chunks)]
        # (point-to-point pairs, not dist.all_to_all: gloo's takes only chunks of one size, and N need not
        # divide by the world size)
        others = [s for s in range(self.world) if s != self.rank]
        arrival = self.start_exchange([([(chunks[s].contiguous(), s) for s in others],
                                        [(received[s], s) for s in others])], 2 * len(others), 0)
        own = chunks[self.rank] if keep_own else None

        def wait():
            arrival()
            out = list(received)
            out[self.rank] = own
            return out
        return wait


def _ring_products(ring: _Ring, local, product, row_dim: int):
    """Runs `product(block, s)` for the row block of every rank s, the local one first. Blocks travel both ways
    round the ring: rank - d's rightwards, rank + d's leftwards (each link busy in both directions: half the
    steps of a one-way ring, the same bytes per link), the next ones in flight while those in hand are
    multiplied; four blocks in memory at most."""
    world, rank = ring.world, ring.rank
    ahead, behind = world // 2, (world - 1) // 2  # (blocks that come rightwards, leftwards: world - 1 in all)
    rightwards = leftwards = local
    for d in range(ahead + 1):
        waits = []
        if d < ahead:
            waits.append(ring.shift(rightwards, ring.counts[(rank - d - 1) % world], row_dim, 1))
        if d < behind:
            waits.append(ring.shift(leftwards, ring.counts[(rank + d + 1) % world], row_dim, -1))
        if d == 0:
            product(local, rank)
        else:
            product(rightwards, (rank - d) % world)
            if d <= behind:
                product(leftwards, (rank + d) % world)
        if waits:
            rightwards = waits[0]()
        if len(waits) > 1:
            leftwards = waits[1]()


def _ring_reduce(ring: _Ring, partial, row_dim: int):
    """Each rank's own block of the sum over ranks of partial(s) (the contribution of this rank's rows to rank
    s's block): a reduce-scatter round the ring, one accumulator block in flight."""
    accumulator = None
    for step in range(ring.world - 1):
        target = (ring.rank - step - 1) % ring.world
        contribution = partial(target)
        accumulator = contribution if accumulator is None else accumulator + contribution
        accumulator = ring.shift(accumulator, ring.counts[(target - 1) % ring.world], row_dim)()
    own = partial(ring.rank)
    return own if accumulator is None else accumulator + own


def _as_planes(t: torch.Tensor) -> torch.Tensor:
    """[..., m, n] as [planes, m, n] (a view where the strides allow; empty blocks too)."""
    return t.reshape(math.prod(t.shape[:-2]), *t.shape[-2:])


def _block_product(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x @ y^T over the last two dims ([B, H, m, k] and [B, H, n, k] -> [B, H, m, n], x's dtype) at the current
    fp32 matmul precision: the contraction kernels' default order for CUDA operands they take (fp32, bf16,
    fp16), PyTorch's matmul otherwise (the CPU, float64)."""
    if not (_kernels_take(x) and x.numel() and y.numel()):
        return x @ y.transpose(-1, -2)
    planes = _as_planes(x).contiguous()
    z = planes.new_empty((planes.shape[0], planes.shape[1], y.shape[-2]))
    contract_into(z, planes, _as_planes(y).contiguous(), None, torch.get_float32_matmul_precision())
    return z.view(*x.shape[:-1], y.shape[-2])


def _add_product_(total: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
    """total += x @ y over the last two dims, in place (cuBLAS's baddbmm: no temporary the size of total; the
    contraction kernels write z, they do not add to it)."""
    total.view(math.prod(total.shape[:-2]), *total.shape[-2:]).baddbmm_(_as_planes(x), _as_planes(y))


SHARDED_STEP_MIN_BYTES = 1 << 26  # (tests set it to 1: one row per step)
def _sharded_steps(pair: torch.Tensor, hidden: int, share: int = 8) -> list:
    """The row spans of the sharded layers' steps: each step's temporaries (LayerNorm_in's rows and one side's
    projections, or z's rows and the output layers: about 4 C + 8 H values per position) within 1 / share of one
    side's planes, at least SHARDED_STEP_MIN_BYTES. share 8: _sharded_inference's; 2: the training row steps'
    (about 25 steps: each step's launches cost host time, and steps of two sides' bytes ran slower: bench/NOTES.md)."""
    batch, rows, n, c = pair.shape
    per_row = max(1, batch * n * (4 * c + 8 * hidden) * pair.element_size())
    side_bytes = batch * rows * n * hidden * pair.element_size()
    return _spans(max(1, min(rows, max(side_bytes // share, SHARDED_STEP_MIN_BYTES) // per_row)), 0, rows)


def _sharded_fused(steps: ForwardSteps, ring: "_Ring", incoming: bool, keep: bool = False) -> tuple:
    """The sharded forward on the fused passes (ModelNew._row_block_steps: planes [B*H, N_r, N], no padding): the
    input pass writes this rank's a / b planes, the exchange contracts them as [B, H, N_r, N], the output pass
    reads z's rows. Returns (out, kept): keep (a backward follows, _ShardedTraining) z's planes [B*H, N_r, N] and
    then what the exchange's backward keeps (_exchange_z); else [] and a and b in buffers of their own, so that each
    is freed as soon as the exchange has sent it (_rows_z), as on the PyTorch layers' path."""
    a_t, b_t = steps.new_side(), steps.new_side()
    steps.input_pass(a_t, b=b_t)
    batch = steps._call[0].shape[0]
    planes = [a_t.view(batch, -1, *a_t.shape[1:]), b_t.view(batch, -1, *b_t.shape[1:])]
    del a_t, b_t  # (the exchange holds the only references)
    if keep:
        z, kept = _exchange_z(*planes, ring, incoming, keep=True)
        planes.clear()
    else:
        z, kept = _rows_z(planes, ring, incoming), None
    z = z.view(-1, *z.shape[2:])
    out = steps.new_out()
    steps.output_pass(out, z=z)
    return out, [z, *kept] if keep else []


class _ShardedTraining(torch.autograd.Function):
    """The sharded training step on the fused passes and the backward roles' kernels for this rank's block of rows
    (ModelNew._sharded_trained). Forward: as _sharded_fused, keeping z's rows and what the exchange's backward
    keeps (_exchange_z). Backward: training_backward's one extension call on the block, its contraction backward
    the exchange's (the call's contract_hook, between output_backward's dz and input_backward). The kept buffers
    are intermediates on the context, handed over and freed once used; under torch.utils.checkpoint's hooks saved
    tensors instead (as _TrimulFunction's). apply(pair, mask, steps, ring, incoming, options, *params): steps the
    block's ForwardSteps (bf16 planes, the outgoing layout), options (kernels, gate_normalized, eps_in, eps_out),
    params the 16 (None for a missing bias)."""

    @staticmethod
    def forward(ctx, pair, mask, steps, ring, incoming, options, *params):
        out, kept = _sharded_fused(steps, ring, incoming, keep=True)  # (kept[0]: z's planes, as the backward takes)
        ctx.ring, ctx.incoming, ctx.options = ring, incoming, options
        ctx.kept_saved = _checkpoint_hooks_active()
        ctx.save_for_backward(pair, mask, *params, *(kept if ctx.kept_saved else []))
        ctx.kept = None if ctx.kept_saved else kept
        return out

    @staticmethod
    def backward(ctx, grad_out):
        _refuse_create_graph()  # (transfers and in-place sums: not differentiable again)
        pair, mask, *params = ctx.saved_tensors
        kept = params[16:] if ctx.kept_saved else ctx.kept
        del params[16:]
        ctx.kept = None
        saved = [kept.pop(0), None, None, None]  # (z: training_backward empties the list)
        kernels, gate_normalized, eps_in, eps_out = ctx.options
        ring, incoming, wanted = ctx.ring, ctx.incoming, ctx.needs_input_grad
        batch, rows, n, _ = pair.shape

        def contract(d_z):  # [B*H, N_r, N] -> (d a, d b) of this rank's rows, by the exchange
            d_a, d_b = _exchange_backward(kept, d_z.view(batch, -1, rows, n), ring, incoming)
            return d_a.reshape(d_z.shape), d_b.reshape(d_z.shape)
        d_pair, d_mask, *d_params = _extension().training_backward(
            grad_out.contiguous(), pair, mask, [p.detach() for p in _with_zero_biases(params)],
            kernels.output_backward or "", kernels.input_backward or "", "", kernels.position_gemm or "",
            _precision_code("bf16"), False, False, gate_normalized, eps_in, eps_out, bool(wanted[1]), bool(wanted[0]),
            any(wanted[6:]), saved, False, contract)
        return (d_pair if wanted[0] else None, d_mask.to(mask.dtype) if wanted[1] else None, None, None, None,
                None) + tuple(g.to(p.dtype) if w else None for g, p, w in zip(d_params, params, wanted[6:]))


class _ShardedContraction(torch.autograd.Function):
    """z's rows of this rank from a/b planes [B, H, N_r, N] of this rank's rows (a_t[b, h, r, k] is position
    (r, k): row r of this rank's block), by the ring's exchange: "channels", _channel_z and _channel_backward;
    "ring", as follows. Outgoing: z[i, j] = sum_k a[i, k] b[j, k], b's row blocks round the
    ring. Incoming: z[i, j] = sum_k a[k, i] b[k, j]: a's column blocks by one all-to-all (each rank then holds
    a[:, its rows]), then b's row blocks round the ring with z accumulated. Backward: the same rings; the
    gradient of a travelling operand (b) is the sum over ranks of each rank's share, reduced round the ring to
    its owner (never a local slice). Outgoing's z blocks run on the contraction kernels (_block_product), a
    quarter of the hidden channels at a time (the product's temporary a quarter of a block); incoming's partial
    sums over k and the backward's products add in place through cuBLAS (_add_product_)."""

    @staticmethod
    def forward(ctx, a_t, b_t, ring, incoming):
        z, kept = _exchange_z(a_t, b_t, ring, incoming, keep=any(ctx.needs_input_grad[:2]))
        ctx.save_for_backward(*kept)
        ctx.ring, ctx.incoming = ring, incoming
        ctx.precision = torch.get_float32_matmul_precision()  # (the layer's; autograd runs backward outside it)
        return z

    @staticmethod
    def backward(ctx, d_z):
        _refuse_create_graph()  # (transfers and in-place sums: not differentiable again)
        with _float32_matmul_precision(ctx.precision):
            return (*_exchange_backward(list(ctx.saved_tensors), d_z, ctx.ring, ctx.incoming), None, None)


def _exchange_z(a_t, b_t, ring: _Ring, incoming: bool, keep: bool):
    """z's rows of this rank [B, H, N_r, N] from a / b planes of its rows by the ring's exchange, and what its
    backward keeps (a list for _exchange_backward; empty unless keep): the channel exchange's each channel group's
    a and b over all rows, the ring's a (incoming: a's column block) and b_t."""
    if ring.exchange == "channels":
        return _channel_z([a_t, b_t], ring, incoming, keep)
    z, a_kept = _sharded_z([a_t, b_t], ring, incoming, keep_a=keep)
    return z, [a_kept, b_t] if keep else []


def _exchange_backward(kept: list, d_z: torch.Tensor, ring: _Ring, incoming: bool) -> tuple:
    """(d a, d b) of this rank's rows from d z's rows [B, H, N_r, N] and _exchange_z's kept list (emptied once
    used: the caller may hold no other reference)."""
    if ring.exchange == "channels":
        grads = _channel_backward(kept, d_z, ring, incoming)
        kept.clear()
        return grads
    a_t, b_t = kept
    kept.clear()
    columns = ring.columns
    d_z = d_z.contiguous()
    if incoming:  # a_t: [B, H, N (k), N_r (i)]; z[i, j] = sum_k a[k, i] b[k, j]
        d_a = torch.empty_like(a_t)

        def product(block, s):
            d_a[:, :, columns[s]] = block @ d_z.transpose(-1, -2)
        _ring_products(ring, b_t, product, 2)
        d_a = torch.cat(ring.all_to_all([d_a[:, :, c] for c in columns]), dim=3)
        d_b = _ring_reduce(ring, lambda s: a_t[:, :, columns[s]] @ d_z, 2)
    else:  # z[i, j] = sum_k a[i, k] b[j, k]
        d_a = torch.zeros_like(a_t)

        def product(block, s):
            _add_product_(d_a, d_z[..., columns[s]], block)
        _ring_products(ring, b_t, product, 2)
        d_b = _ring_reduce(ring, lambda s: d_z[..., columns[s]].transpose(-1, -2) @ a_t, 2)
    return d_a, d_b


def _sharded_z(planes: list, ring: _Ring, incoming: bool, keep_a: bool):
    """_ShardedContraction's forward: (z's rows of this rank, what the backward keeps of a: a_t, or for incoming a's
    column block [B, H, N, N_r]; None unless keep_a). planes = [a_t, b_t], emptied by the call. Where the caller
    holds no other reference (the no-gradient forward), incoming frees a_t before b's ring allocates its first
    block: the own chunk's product runs first, while the all-to-all of the others' chunks is in flight (whose
    sends are copies), so the rank never holds a's rows, a's column block and a block of b at once."""
    a_t, b_t = planes
    planes.clear()
    columns = ring.columns
    if incoming:  # a[k, i] for every k and this rank's i, chunk by chunk of k
        chunks = [a_t[..., c] for c in columns]
        arrival = ring.start_all_to_all(chunks, keep_own=keep_a)
        own = chunks[ring.rank]
        received = {}  # (the own chunk's product runs while the others arrive)
        z = a_t.new_zeros(a_t.shape[:2] + (own.shape[3], b_t.shape[3]))
        del a_t, chunks
        if not keep_a:  # (the own term now; then nothing holds a_t)
            _add_product_(z, own.transpose(-1, -2), b_t)
            del own

        def product(block, s):
            if s == ring.rank:
                if keep_a:
                    _add_product_(z, own.transpose(-1, -2), block)
                return
            if not received:
                received.update(enumerate(arrival()))
            _add_product_(z, received[s].transpose(-1, -2), block)
    else:
        z = a_t.new_empty(a_t.shape[:3] + (sum(ring.counts),))

        def product(block, s):
            for part in _block_product_channels(a_t.shape[1]):
                z[:, part, :, columns[s]] = _block_product(a_t[:, part], block[:, part])
    _ring_products(ring, b_t, product, 2)
    if incoming and not received:  # (one rank: nothing arrives, but the exchange is closed all the same)
        received.update(enumerate(arrival()))
    if not keep_a:
        return z, None
    if incoming:
        return z, torch.cat([received[s] for s in range(ring.world)], dim=2)  # (received[rank]: the own chunk)
    return z, a_t


def _rows_z(planes: list, ring: _Ring, incoming: bool) -> torch.Tensor:
    """z's rows of this rank [B, H, N_r, N] with no gradient needed, by the ring's exchange (planes = [a_t, b_t],
    emptied: _sharded_z, _channel_z)."""
    return (_channel_z if ring.exchange == "channels" else _sharded_z)(planes, ring, incoming, False)[0]


# The channel exchange: the contraction is independent per hidden channel, so rank s contracts all N rows of the
# channels it owns (shard_rows(H, P, s)); a and b travel from their rows' ranks to the channels' owners and z's
# rows back (each rank sends (P - 1) / P of its a, b and z blocks, for either direction: no ring, no reduction,
# no all-to-all of a). A rank's channels go in groups, so that group g + 1's a / b and group g - 1's z are in
# flight while group g is multiplied. Messages are one (batch element, channel)'s rows, contiguous on both sides.
SHARD_CHANNEL_GROUPS = 8  # (groups per rank: the first group's a / b and the last's z are the exposed transfers)


def _channel_parts(hidden: int, world: int) -> list:
    """parts[g][s]: the hidden channels of rank s's g-th group (rank s owns shard_rows(hidden, world, s), split
    into min(SHARD_CHANNEL_GROUPS, the most any rank owns) groups alike on every rank; a rank owning fewer
    channels has empty groups)."""
    owners = [shard_rows(hidden, world, s) for s in range(world)]
    groups = max(1, min(SHARD_CHANNEL_GROUPS, max(len(o) for o in owners)))
    parts = []
    for g in range(groups):
        spans = [shard_rows(len(o), groups, g) for o in owners]
        parts.append([range(o.start + span.start, o.start + span.stop) for o, span in zip(owners, spans)])
    return parts


def _start_to_channels(ring: _Ring, blocks: list, part: list, tag: int = 3):
    """Starts moving channel group `part` of row blocks [B, H, N_r, N] (this rank's rows, contiguous) to the
    channels' owners; returns arrived() -> per block [B, len(part[rank]), N, N]: this rank's channels of the group
    over all N rows (rank s's rows from rank s)."""
    rank, columns, own = ring.rank, ring.columns, part[ring.rank]
    batch, n = blocks[0].shape[0], blocks[0].shape[3]
    outs = [block.new_empty((batch, len(own), sum(ring.counts), n)) for block in blocks]
    for block, out in zip(blocks, outs):
        out[:, :, columns[rank]] = block[:, own.start:own.stop]
    units = _element_units(ring, batch, n, len(blocks),
                           lambda b, i, s: [(blocks[i][b, h], s) for h in part[s]] if ring.counts[rank] else [],
                           lambda b, i, s: [(outs[i][b, h - own.start, columns[s]], s) for h in own]
                           if ring.counts[s] else [])
    wait = ring.start_exchange(units, _unit_bound(ring, part, len(blocks)), tag)

    def arrived():
        wait()
        return outs
    return arrived


def _start_to_rows(ring: _Ring, channels: list, part: list, blocks: list, tag: int = 4):
    """_start_to_channels' inverse: this rank's channels of group `part` over all N rows (channels: [B,
    len(part[rank]), N, N] each) into the row blocks [B, H, N_r, N] of their ranks (blocks: this rank's, filled
    at the group's channels of every rank). Returns wait()."""
    rank, columns, own = ring.rank, ring.columns, part[ring.rank]
    batch, n = blocks[0].shape[0], blocks[0].shape[3]
    channels = [values.contiguous() for values in channels]
    for values, block in zip(channels, blocks):
        block[:, own.start:own.stop] = values[:, :, columns[rank]]
    units = _element_units(ring, batch, n, len(blocks),
                           lambda b, i, s: [(channels[i][b, h - own.start, columns[s]], s) for h in own]
                           if ring.counts[s] else [],
                           lambda b, i, s: [(blocks[i][b, h], s) for h in part[s]] if ring.counts[rank] else [])
    return ring.start_exchange(units, _unit_bound(ring, part, len(blocks)), tag)


def _element_units(ring: _Ring, batch: int, n: int, tensors: int, sends, receives) -> list:
    """start_exchange's units, one per batch element b: sends(b, i, s) and receives(b, i, s), the messages of
    tensor i with each other rank s, in the order (i, s) on every rank; none where N = 0."""
    units = []
    for b in range(batch):
        unit = ([], [])
        for i in range(tensors):
            for s in range(ring.world):
                if s != ring.rank and n:
                    unit[0].extend(sends(b, i, s))
                    unit[1].extend(receives(b, i, s))
        units.append(unit)
    return units


def _unit_bound(ring: _Ring, part: list, tensors: int) -> int:
    """The most messages one batch element of an exchange of `tensors` tensors over channel group `part` has on any
    rank: a send and a receive per other rank and channel (start_exchange's bound, alike on every rank)."""
    return tensors * 2 * (ring.world - 1) * max(len(channels) for channels in part)


def _channel_pipeline(ring: _Ring, sources: list, work, targets: list) -> None:
    """The channel exchange's skeleton, forward and backward: for each channel group g, the group's rows of
    `sources` (this rank's row blocks [B, H, N_r, N]) arrive at their channels' owners, work(g, arrived) turns
    them into results over all rows, which go back to the rows' ranks, into `targets` (row blocks); group g + 1's
    arrival and group g - 1's departure in flight during work(g, ...). sources is emptied once the last group
    has been sent (where the caller holds no other reference, its blocks are freed before the last work)."""
    parts = _channel_parts(sources[0].shape[1], ring.world)
    arrivals = [_start_to_channels(ring, sources, parts[0])]
    leaving = None
    for g, part in enumerate(parts):
        if g + 1 < len(parts):
            arrivals.append(_start_to_channels(ring, sources, parts[g + 1]))
        else:
            sources.clear()
        arrived = arrivals[g]()
        arrivals[g] = None
        results = work(g, arrived)
        del arrived
        previous, leaving = leaving, _start_to_rows(ring, results, part, targets)
        del results
        if previous is not None:
            previous()
    leaving()


def _channel_z(planes: list, ring: _Ring, incoming: bool, keep: bool):
    """The channel exchange's forward: (z's rows of this rank [B, H, N_r, N], what the backward keeps: each
    channel group's a and b over all rows, [a_0, b_0, a_1, b_1, ...]; empty unless keep). planes = [a_t, b_t],
    emptied by the call: where the caller holds no other reference, they are freed once the last group has
    been sent. Outgoing's products z = a b^T on the contraction kernels (_block_product), incoming's z = a^T b
    through cuBLAS (matmul reads the transposed operand in place)."""
    sides = [side.contiguous() for side in planes]  # (each channel's rows are sent as they lie)
    planes.clear()
    z_t = torch.empty_like(sides[0], memory_format=torch.contiguous_format)
    kept = []

    def product(g, arrived):
        a_c, b_c = arrived
        if keep:
            kept.extend(arrived)
        return [a_c.transpose(-1, -2) @ b_c if incoming else _block_product(a_c, b_c)]
    _channel_pipeline(ring, sides, product, [z_t])
    return z_t, kept


def _channel_backward(kept: list, d_z: torch.Tensor, ring: _Ring, incoming: bool) -> tuple:
    """The channel exchange's backward: (d a_t, d b_t) of this rank's rows. d_z's rows go to the channels' owners,
    each group's gradients over all rows (z = a b^T: da = dz b, db = dz^T a; incoming z = a^T b: da = b dz^T,
    db = a dz) back to their rows, pipelined as the forward. No sum across ranks: a channel is one rank's."""
    d_z = d_z.contiguous()
    d_a, d_b = torch.empty_like(d_z), torch.empty_like(d_z)

    def gradients(g, arrived):
        (dz_c,), a_c, b_c = arrived, kept[2 * g], kept[2 * g + 1]
        if incoming:
            return [b_c @ dz_c.transpose(-1, -2), a_c @ dz_c]
        return [dz_c @ b_c, dz_c.transpose(-1, -2) @ a_c]
    _channel_pipeline(ring, [d_z], gradients, [d_a, d_b])
    return d_a, d_b


# What every rank of a sharded call must agree on beyond valid input: the sizes and the operands the exchange moves
# (a rank with another dtype, hidden size, precision or autocast would send blocks the others misread, or wait in
# a collective the others never enter), whether a backward follows (the transfers it runs) and the exchange.
_AGREED = ("B", "N", "pair_dim", "hidden_dim", "direction", "gate_input", "pair dtype", "precision mode",
           "autocast", "gradients needed", "exchange")


def _code(value) -> int:
    """A name or dtype as an int that every process computes alike (str hashes differ between processes)."""
    return zlib.crc32(str(value).encode()) & 0x7FFFFFFF


def _sharded_agreement(layers, ring: _Ring, pair_repr, pair_mask) -> list:
    """_AGREED's values on this rank (after check_inputs passed), as ints."""
    batch, _, n, pair_dim = pair_repr.shape
    device = pair_repr.device.type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    mode = compute_mode(pair_repr.dtype, layers.resolved_precision())
    return [batch, n, pair_dim, layers.hidden_dim, _code(layers.direction), _code(layers.gate_input),
            _code(pair_repr.dtype), _code(mode), _code(autocast), int(layers._needs_autograd(pair_repr, pair_mask)),
            _code(ring.exchange)]


def _check_sharded_inputs(layers, ring: _Ring, pair_repr, pair_mask) -> None:
    """Every rank checks its block and learns whether any rank's was bad or disagrees with the others (_AGREED;
    one all-gather, under the group's timeout), so a bad block raises on every rank instead of leaving the
    others waiting in the exchange or reading blocks of another layout."""
    problem = None
    try:
        if isinstance(pair_repr, torch.Tensor) and pair_repr.dim() == 4:
            batch, rows, n, _ = pair_repr.shape
            expected = len(shard_rows(n, ring.world, ring.rank))
            if rows != expected:
                raise ValueError(f"pair_repr has {rows} rows on rank {ring.rank} of {ring.world}, but N = {n} gives "
                                 f"this rank {expected} (torch.tensor_split(torch.arange(N), world)[rank])")
        check_inputs(layers, pair_repr, pair_mask, rows=ring.counts[ring.rank])
        agreed = _sharded_agreement(layers, ring, pair_repr, pair_mask)
    except (ValueError, TypeError) as error:
        problem, agreed = error, [-1] * len(_AGREED)
    # (on NCCL the flags travel on this process's GPU whatever the input's device: a CPU tensor there would fail
    # this rank's all-gather alone and leave the others waiting)
    if ring.dist.get_backend(ring.group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        cuda = isinstance(pair_repr, torch.Tensor) and pair_repr.is_cuda and not ring.stage
        device = pair_repr.device if cuda else torch.device("cpu")
    flags = torch.tensor([1 if problem else 0] + agreed, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(flags) for _ in range(ring.world)]
    ring.dist.all_gather(gathered, flags, group=ring.group)
    if problem is not None:
        raise problem
    gathered = [g.tolist() for g in gathered]
    bad = [r for r, g in enumerate(gathered) if g[0]]
    if bad:
        raise ValueError(f"trimul_inline: rank(s) {bad} got invalid input (see their errors); rank {ring.rank} "
                         "stops too")
    differ = [name for i, name in enumerate(_AGREED) if len({g[1 + i] for g in gathered}) != 1]
    if differ:
        sizes = {name: [g[1 + _AGREED.index(name)] for g in gathered] for name in ("B", "N", "pair_dim", "hidden_dim")}
        shown = {k: v for k, v in sizes.items() if k in differ}
        raise ValueError(f"trimul_inline: the ranks of a sharded call disagree on {', '.join(differ)}"
                         + (f" (per rank: {shown})" if shown else " (each rank's model, inputs, precision, autocast and "
                            "grad mode must match)"))


# ------------------------------------------------------------------------------------------------
# Other models' layers (OpenFold, OpenFold3, Protenix, Boltz-1/2; AlphaFold2's parameters), recognised by
# their parameter names: from_module copies one into a ModelNew, replace_modules runs them on ModelNew in place
# ------------------------------------------------------------------------------------------------
class _HostLayout(NamedTuple):
    """Where a host layer keeps each of our submodules' parameters: ours -> (its submodule, rows), rows
    "a" / "b": the first / second half of a fused projection, None: all of it."""
    kind: str
    parts: dict


_HOST_LAYOUTS = (
    _HostLayout("openfold", {"layer_norm_in": ("layer_norm_in", None), "proj_a": ("linear_a_p", None),
                             "gate_a": ("linear_a_g", None), "proj_b": ("linear_b_p", None),
                             "gate_b": ("linear_b_g", None), "layer_norm_out": ("layer_norm_out", None),
                             "out_proj": ("linear_z", None), "out_gate": ("linear_g", None)}),
    _HostLayout("openfold_fused", {"layer_norm_in": ("layer_norm_in", None), "proj_a": ("linear_ab_p", "a"),
                                   "gate_a": ("linear_ab_g", "a"), "proj_b": ("linear_ab_p", "b"),
                                   "gate_b": ("linear_ab_g", "b"), "layer_norm_out": ("layer_norm_out", None),
                                   "out_proj": ("linear_z", None), "out_gate": ("linear_g", None)}),
    _HostLayout("boltz", {"layer_norm_in": ("norm_in", None), "proj_a": ("p_in", "a"), "gate_a": ("g_in", "a"),
                          "proj_b": ("p_in", "b"), "gate_b": ("g_in", "b"), "layer_norm_out": ("norm_out", None),
                          "out_proj": ("p_out", None), "out_gate": ("g_out", None)}),
)
_LINEARS = ("proj_a", "gate_a", "proj_b", "gate_b", "out_proj", "out_gate")


def _host_layout(module) -> Optional[_HostLayout]:
    """The layout whose submodules the module has (each with a weight), or None."""
    children = dict(module.named_children())
    for layout in _HOST_LAYOUTS:
        wanted = {host for host, _ in layout.parts.values()}
        if all(getattr(children.get(name), "weight", None) is not None for name in wanted):
            return layout
    return None


def _expected_layouts() -> str:
    return "; ".join(f"{layout.kind}: " + ", ".join(dict.fromkeys(host for host, _ in layout.parts.values()))
                     for layout in _HOST_LAYOUTS)


def _host_tensor(module, layout: _HostLayout, ours: str, name: str):
    """Our (submodule, parameter) as the host's tensor (a view for a half of a fused projection), or None."""
    host, rows = layout.parts[ours]
    tensor = getattr(getattr(module, host), name, None)
    if tensor is None or rows is None:
        return tensor
    half = tensor.shape[0] // 2
    return tensor[:half] if rows == "a" else tensor[half:]


def _host_params(module, layout: _HostLayout) -> list:
    """The 16 tensors of _PARAM_PATHS from the host's own (views where fused: gradients reach the host's)."""
    return [_host_tensor(module, layout, ours, name) for ours, name in _PARAM_PATHS]


def _host_direction(module, direction: Optional[str]) -> str:
    """The host layer's direction: its `_outgoing` flag (OpenFold's, OpenFold3's and Protenix's layers keep it),
    else its class name; a direction given must agree with the flag."""
    if direction is not None and direction not in DIRECTIONS:
        raise ValueError(f"direction must be None or one of {DIRECTIONS}, got {direction!r}")
    flag = getattr(module, "_outgoing", None)
    if isinstance(flag, bool):
        own = "outgoing" if flag else "incoming"
        if direction is not None and direction != own:
            raise ValueError(f"trimul_inline: direction={direction!r} given, but {type(module).__name__} has "
                             f"_outgoing={flag} ({own})")
        return own
    if direction is not None:
        return direction
    name = type(module).__name__.lower()
    found = [d for d in DIRECTIONS if d in name]
    if len(found) != 1:
        raise ValueError(f"trimul_inline: cannot tell the direction of {type(module).__name__} from its name; "
                         f"pass direction='outgoing' or 'incoming'")
    return found[0]


def _host_options(module, layout: _HostLayout, direction: Optional[str]) -> dict:
    """ModelNew's constructor options for a host layer: sizes, direction (_host_direction), the gate on the
    normalized input, biases (all six Linears alike) and the LayerNorms' eps."""
    direction = _host_direction(module, direction)
    biases = {ours: _host_tensor(module, layout, ours, "bias") is not None for ours in _LINEARS}
    if len(set(biases.values())) != 1:
        raise ValueError(f"trimul_inline: {type(module).__name__} has biases on some Linears only "
                         f"({', '.join(k for k, v in biases.items() if v)}); ModelNew takes all six or none")
    weight = _host_tensor(module, layout, "proj_a", "weight")
    eps = {ours: float(getattr(getattr(module, layout.parts[ours][0]), "eps", 1e-5))
           for ours in ("layer_norm_in", "layer_norm_out")}
    return dict(pair_dim=weight.shape[1], hidden_dim=weight.shape[0], direction=direction, gate_input="normalized",
                bias=biases["proj_a"], eps=eps)


def _new_for_host(module, layout, direction, kernels, precision):
    options = _host_options(module, layout, direction)
    eps = options.pop("eps")
    new = ModelNew(**options, kernels=kernels, precision=precision)
    for ours, value in eps.items():
        getattr(new, ours).eps = value
    return new


def _recognised_layout(module, caller: str) -> _HostLayout:
    if not isinstance(module, nn.Module):
        raise TypeError(f"trimul_inline.{caller}: expected a torch.nn.Module, got {type(module).__name__}")
    layout = _host_layout(module)
    if layout is None:
        raise TypeError(f"trimul_inline.{caller}: {type(module).__name__} is not a recognised triangle "
                        f"multiplicative update; expected submodules ({_expected_layouts()})")
    return layout


def from_module(module: nn.Module, direction: Optional[str] = None, kernels=None,
                precision: Optional[str] = None) -> "ModelNew":
    """A ModelNew with a host layer's semantics and a copy of its weights, on its device and dtype: OpenFold's,
    OpenFold3's and Protenix's TriangleMultiplicationOutgoing / Incoming (plain or fused projections, with or
    without biases) and Boltz-1/2's, recognised by their parameter names; the gate reads the normalized input.
    direction: None takes it from the layer's `_outgoing` flag or else its class name. A module of no known
    layout raises TypeError naming what is expected; a direction that cannot be told or contradicts the
    layer's flag, or biases on some Linears only, ValueError."""
    layout = _recognised_layout(module, "from_module")
    source = _host_params(module, layout)
    weight = source[2]
    # (moved before the copy: a float64 host's weights must not pass through the default dtype)
    new = _new_for_host(module, layout, direction, kernels, precision).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        for (ours, name), tensor in zip(_PARAM_PATHS, source):
            if tensor is not None:
                getattr(getattr(new, ours), name).copy_(tensor)
    return new


# The host forwards' arguments beyond (pair, mask) that replace_modules knows; any other argument passed with a
# value other than its default raises (its effect on the result is unknown here).
_HOST_ARGUMENTS = ("inplace_safe", "_add_with_inplace", "_inplace_chunk_size", "use_cueq_triangle_kernels",
                   "triangle_multiplicative", "use_kernels")
_HOST_KERNEL_CHOICES = ("torch", "cuequivariance")  # Protenix's triangle_multiplicative values


def _openfold_forward(z, mask=None, inplace_safe=False, _add_with_inplace=False, _inplace_chunk_size=None):
    """(The signature a host forward that Python cannot read is bound with: OpenFold's.)"""


def _host_signature(module) -> inspect.Signature:
    """The host's forward signature without self (OpenFold's where Python cannot read it)."""
    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        parameters = []
    return inspect.Signature(parameters) if len(parameters) >= 2 else inspect.signature(_openfold_forward)


def _host_mask(pair: torch.Tensor, mask) -> torch.Tensor:
    """The host's optional mask broadcast to the pair's positions [*, N, N] (None: all ones)."""
    return pair.new_ones(pair.shape[:-1]) if mask is None else torch.broadcast_to(mask, pair.shape[:-1])


def _plain_attributes(module) -> dict:
    """The host instance's plain attributes (sizes, flags such as OpenFold's c_z, c_hidden, _outgoing)."""
    return {k: v for k, v in vars(module).items() if isinstance(v, (bool, int, float, str)) and k != "training"}


def _leading_flattened(t: torch.Tensor, trailing: int) -> torch.Tensor:
    """t [*, trailing dims] as [B, trailing dims] (a view where t's strides allow one)."""
    return t.reshape((-1,) + tuple(t.shape[t.dim() - trailing:]))


class _HostLayer(nn.Module):
    """A host layer running on ModelNew (replace_modules): the host's own submodules under their names (so the
    model's state_dict and optimizer see the same parameters), its plain attributes, its call signature
    (arguments bound as the host's forward binds them) and its semantics:
    - pair [*, N, N, C] and mask [*, N, N] (broadcast to the pair's; None: all ones), any leading dims;
    - OpenFold's inplace_safe: z is overwritten with the update (with _add_with_inplace: z + update) and
      returned (under no grad: the chunked forward into z, _inplace_chunk_size rows at a time); the fused
      layer's inplace_safe without _add_with_inplace returns the update and leaves z as it was;
    - OpenFold3's use_cueq_triangle_kernels: the update, not in place (its cuEquivariance path);
    - Protenix's triangle_multiplicative="cuequivariance" at c_z = c_hidden: the update, or z + update in a
      new tensor with inplace_safe and _add_with_inplace (its cuEquivariance path); other values raise;
    - Boltz's use_kernels picks Boltz's own kernels: no effect on the result."""

    def __init__(self, module, layout, new):
        super().__init__()
        for host, child in module.named_children():  # (all of them, in order: the same state_dict keys)
            self.add_module(host, child)
        for name, value in _plain_attributes(module).items():
            setattr(self, name, value)
        self.training = module.training
        self.layout, self.host_class = layout, type(module).__name__
        self.host_signature = _host_signature(module)
        # (not a submodule: the parameters it runs on are the host's, read through _source)
        object.__setattr__(self, "model_new", new)
        new._source = self._params

    def _params(self):
        return _host_params(self, self.layout)

    def _bound(self, args, kwargs) -> tuple:
        """(pair, mask, the known arguments passed) as the host's forward would bind them."""
        signature = self.host_signature
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{self.host_class}.forward (on trimul_inline): {error}") from None
        names = list(signature.parameters)
        passed = dict(bound.arguments)
        for name, parameter in signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD and name in passed:
                passed.update(passed.pop(name))
        pair, mask = passed.pop(names[0]), passed.pop(names[1], None)
        for name, value in passed.items():
            default = signature.parameters[name].default if name in signature.parameters else None
            at_default = value is default or (isinstance(value, (bool, int, float, str)) and value == default)
            if name not in _HOST_ARGUMENTS and not at_default:
                raise TypeError(f"{self.host_class}.forward (on trimul_inline): argument {name}={value!r} is not "
                                f"one trimul_inline knows ({', '.join(_HOST_ARGUMENTS)}); its effect cannot be kept")
        return pair, mask, passed

    def _update(self, pair, mask):
        """The update for pair [*, N, N, C] (the layer's output, not added)."""
        out = self.model_new(_leading_flattened(pair, 3), _leading_flattened(_host_mask(pair, mask), 2))
        return out.reshape(pair.shape)

    def _into(self, z, mask, add: bool, chunk_size):
        """z overwritten with the update (add: z + update), chunk_size rows at a time, under no grad; z."""
        mask = _host_mask(z, mask)
        try:
            z4 = z.view((-1,) + tuple(z.shape[-3:]))
        except RuntimeError:  # (strides with no 4-D view: work on a copy, written back)
            z4 = _leading_flattened(z, 3).clone()
        self.model_new.forward_chunked(z4, _leading_flattened(mask, 2), chunk_size, out=z4, add=add)
        if z4.data_ptr() != z.data_ptr():
            z.copy_(z4.view(z.shape))
        return z

    def forward(self, *args, **kwargs):
        pair, mask, passed = self._bound(args, kwargs)
        inplace, add = bool(passed.get("inplace_safe", False)), bool(passed.get("_add_with_inplace", False))
        choice = passed.get("triangle_multiplicative", "torch")
        if choice not in _HOST_KERNEL_CHOICES:
            raise ValueError(f"triangle_multiplicative must be 'cuequivariance' or 'torch', but got {choice!r}")
        if choice == "cuequivariance" and self.model_new.pair_dim == self.model_new.hidden_dim:
            update = self._update(pair, mask)
            return update + pair if inplace and add else update
        if (passed.get("use_cueq_triangle_kernels", False) or not inplace
                or (self.layout.kind == "openfold_fused" and not add)):  # (the update in a new tensor)
            return self._update(pair, mask)
        if not torch.is_grad_enabled():
            return self._into(pair, mask, add, passed.get("_inplace_chunk_size"))
        update = self._update(pair, mask)
        return pair.add_(update) if add else pair.copy_(update)

    def extra_repr(self) -> str:
        return f"{self.host_class} on trimul_inline ({self.model_new.direction})"


def replace_modules(model: nn.Module, kernels=None, precision: Optional[str] = None) -> int:
    """Swaps every recognised triangle multiplicative update inside `model` (from_module's kinds) for one running
    on ModelNew, in place: same parameters (shared, not copied: the state_dict, optimizers and checkpoints are
    unchanged), the host's call signature and semantics (_HostLayer). Returns how many it replaced. Every
    layer is converted before any is swapped: an error leaves the model as it was."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"trimul_inline.replace_modules: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(model, _HostLayer) and _host_layout(model) is not None:
        raise ValueError(f"trimul_inline.replace_modules: the model itself is a {type(model).__name__}; it swaps "
                         "submodules: use from_module(model), or pass the model that holds it")
    swaps = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _HostLayer):
                continue
            layout = _host_layout(child)
            if layout is not None:
                swaps.append((parent, name, _HostLayer(child, layout, _new_for_host(child, layout, None, kernels,
                                                                                    precision))))
    for parent, name, layer in swaps:
        setattr(parent, name, layer)
    return len(swaps)


# AlphaFold2's Haiku module names -> ours, per direction (incoming: a from the right projections). Its fused
# form (AlphaFold-Multimer v2.3's fuse_projection_weights) holds left | right as the halves of one projection.
_ALPHAFOLD_NAMES = {
    "layer_norm_input": "layer_norm_in", "center_layer_norm": "layer_norm_out", "output_projection": "out_proj",
    "gating_linear": "out_gate",
}
_ALPHAFOLD_FUSED_NAMES = {
    "left_norm_input": "layer_norm_in", "center_norm": "layer_norm_out", "output_projection": "out_proj",
    "gating_linear": "out_gate",
}
_ALPHAFOLD_SIDES = {"outgoing": {"left": "a", "right": "b"}, "incoming": {"left": "b", "right": "a"}}


def _alphafold_nested(params: Mapping) -> Mapping:
    """params as {module path: {parameter: array}}: AlphaFold's flat checkpoint keys ("path/module//weights", as
    numpy.load of its .npz gives them) grouped by module; a nested mapping as it is."""
    flat = [key for key in params if "//" in str(key)]
    if not flat:
        return params
    if len(flat) != len(params):
        raise ValueError("trimul_inline.from_alphafold_params: params mixes flat keys ('module//parameter') with "
                         "module entries")
    nested = {}
    for key, value in params.items():
        module, name = str(key).rsplit("//", 1)
        nested.setdefault(module, {})[name] = value
    return nested


def _alphafold_entry(params, name: str):
    """The entry of Haiku module `name` in params: its full path's last component or the name itself."""
    found = [key for key in params if str(key).rsplit("/", 1)[-1] == name]
    if len(found) != 1:
        raise ValueError(f"trimul_inline.from_alphafold_params: {'no' if not found else 'several'} entries for "
                         f"{name!r} ({found or sorted(map(str, params))[:8]}); pass one block's parameters")
    return params[found[0]]


def _alphafold_linear(entry) -> tuple:
    return entry["weights"], entry["bias"]


def _alphafold_values(params, direction: str) -> dict:
    """Our (submodule, parameter) -> AlphaFold's array (Linear weights still [in, out]), plain or fused form."""
    fused = any(str(key).rsplit("/", 1)[-1] == "projection" for key in params)
    values = {}
    for haiku, ours in (_ALPHAFOLD_FUSED_NAMES if fused else _ALPHAFOLD_NAMES).items():
        entry = _alphafold_entry(params, haiku)
        if ours.startswith("layer_norm"):
            values[(ours, "weight")], values[(ours, "bias")] = entry["scale"], entry["offset"]
        else:
            values[(ours, "weight")], values[(ours, "bias")] = _alphafold_linear(entry)
    for side, letter in _ALPHAFOLD_SIDES[direction].items():
        for kind, ours in (("projection", f"proj_{letter}"), ("gate", f"gate_{letter}")):
            if not fused:
                values[(ours, "weight")], values[(ours, "bias")] = _alphafold_linear(
                    _alphafold_entry(params, f"{side}_{kind}"))
                continue
            weight, bias = _alphafold_linear(_alphafold_entry(params, kind))  # (arrays: converted once, later)
            if weight.shape[-1] % 2 or bias.shape[-1] != weight.shape[-1]:
                raise ValueError(f"trimul_inline.from_alphafold_params: the fused {kind!r} has shape "
                                 f"{tuple(weight.shape)} / bias {tuple(bias.shape)}; expected [in, 2 hidden] / "
                                 "[2 hidden]")
            half = weight.shape[-1] // 2
            part = slice(0, half) if side == "left" else slice(half, None)
            values[(ours, "weight")], values[(ours, "bias")] = weight[..., part], bias[..., part]
    return values


def _as_tensor(value, what: str) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    if not tensor.is_floating_point():
        raise TypeError(f"trimul_inline.from_alphafold_params: {what} must be floating, got {tensor.dtype}")
    return tensor


def _alphafold_model(cls, params, direction: str, kernels=None, precision: Optional[str] = None):
    """ModelNew.from_alphafold_params' body."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if not isinstance(params, Mapping):
        raise TypeError(f"trimul_inline.from_alphafold_params: params must be a mapping of module names to "
                        f"{{parameter: array}}, got {type(params).__name__}")
    values = _alphafold_values(_alphafold_nested(params), direction)
    values = {key: _as_tensor(value, f"{key[0]}.{key[1]}") for key, value in values.items()}
    for key, tensor in values.items():
        expected = 2 if key[1] == "weight" and not key[0].startswith("layer_norm") else 1
        if tensor.dim() != expected:
            raise ValueError(f"trimul_inline.from_alphafold_params: {key[0]}.{key[1]} has shape {tuple(tensor.shape)},"
                             f" expected {expected}-D (one block's parameters, not a stack of blocks)")
        if expected == 2:  # (Haiku stores Linear weights as [in, out])
            values[key] = tensor.t()
    pair_dim, hidden = values[("layer_norm_in", "weight")].shape[0], values[("proj_a", "weight")].shape[0]
    dtype = values[("layer_norm_in", "weight")].dtype
    model = cls(pair_dim, hidden, direction, "normalized", kernels=kernels, precision=precision).to(dtype)
    with torch.no_grad():
        for (ours, name), tensor in values.items():
            target = getattr(getattr(model, ours), name)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"trimul_inline.from_alphafold_params: {ours}.{name} has shape "
                                 f"{tuple(tensor.shape)}, expected {tuple(target.shape)} (pair_dim {pair_dim}, "
                                 f"hidden {hidden})")
            target.copy_(tensor)
    return model


# ------------------------------------------------------------------------------------------------
# Notebook bundle and command line
# ------------------------------------------------------------------------------------------------
_EMBED_LINE = re.compile(r"^_EMBEDDED_KERNELS = None\b.*$", re.M)


def _python_literal(text: str) -> str:
    if "'''" not in text and not text.endswith(("\\", "'")):  # (a closing quote would run into the delimiter)
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
    sub.add_parser("build", help="compile the CUDA extension and kernel library now (or reuse the cached build)")
    sub.add_parser("kernels", help="every kernel of every role: name, default rank, when it applies (no build)")
    args = parser.parse_args(argv)
    if args.command == "bundle":
        text = bundle_source()
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.output} ({len(text)} bytes); exec it or paste it into a notebook cell")
    elif args.command == "kernels":
        print(format_registry())
    else:
        module = load_extension(verbose=True if _verbose() else None)
        print(f"extension: {module.__file__}\nkernel library: {module.kernel_library}")
        for role in ROLES:
            print(f"{role}: " + ", ".join(name for r, name, _, torch_, *_ in module.kernels()
                                          if r == role and not torch_))
    return 0


if __name__ == "__main__" and not sys._getframe().f_code.co_filename.startswith("<"):
    sys.exit(main())  # (not when exec'd from text, as a notebook runs the bundle: its argv is not ours)
