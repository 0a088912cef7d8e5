"""sparkrelay's own CPU kernels (sparkrelay/csrc/): AVX-512 weight-only linears for the few rows of
a decode step (cpu_linear.cpp) and a layer's other steps in one pass each, built once with
torch.utils.cpp_extension (g++ and ninja) and loaded from build/cpu_kernels/ after that; the build
is redone when a source or the flags change.

They are used where the CPU has the instructions (avx512f/bw/vl, avx512_bf16, avx512_vnni) unless
SPARKRELAY_CPU_KERNELS=0; on a CPU with AMX their bf16 and int8 products run on
the tile unit unless SPARKRELAY_CPU_AMX=0 (so 8 rows cost about what one does). A CPU with AVX2 and
FMA but not those gets all but the int8 product and AMX, built apart (cpu_linear_avx2.cpp,
cpu_rows_avx2.cpp, cpu_attention_heads_avx2.cpp; `portable()`), so a bf16 model's decode reads bf16
weights and runs its layers in one call each there too. Anywhere else, or when a build fails (no
compiler, no ninja), the linears stay on oneDNN (kernels.PackedLinear), and the reason is logged once as a
warning: a missing kernel costs speed, never a start. Set-up builds them:
`python -m sparkrelay.models.cpu_kernels` prints what it did. Design: docs/cpu_kernels.md.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Iterator, Optional

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "cpu_linear.cpp",
        "cpu_attention.cpp",
        "cpu_attention_heads.cpp",
        "cpu_mask.cpp",
        "cpu_argmax.cpp",
        "cpu_draw.cpp",
        "cpu_rows.cpp",
        "cpu_elementwise.cpp",
        "cpu_kernel_linear.cpp",
        "cpu_decode_layer.cpp",
        "cpu_markov.cpp",
        "bindings.cpp",
    )
]
BUILD = Path(os.environ.get("SPARKRELAY_KERNEL_BUILD", CSRC.parents[1] / "build" / "cpu_kernels"))
NEEDED = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]
FLAGS += ["-mavx512vnni", "-fopenmp"]
FLAGS += ["-mamx-tile", "-mamx-bf16", "-mamx-int8"]  # used only where the CPU has them (use_amx)
# the AVX2 build: all but the int8 product and AMX (csrc/cpu_kernels.h says what it sees)
AVX2_SOURCES = [
    CSRC / n
    for n in (
        "cpu_linear_avx2.cpp",
        "cpu_rows_avx2.cpp",
        "cpu_kernel_linear.cpp",
        "cpu_argmax.cpp",
        "cpu_draw.cpp",
        "cpu_mask.cpp",
        "cpu_markov.cpp",
        "cpu_attention.cpp",
        "cpu_attention_heads_avx2.cpp",
        "cpu_elementwise.cpp",
        "cpu_decode_layer.cpp",
        "bindings.cpp",
    )
]
AVX2_NEEDED = ("avx2", "fma")
AVX2_NOTE = (
    "the AVX2 build serves bf16 decoder layers of a few rows (linears, norms, RoPE, attention), "
    "argmax, draws, grammar masks and the Markov head, oneDNN and torch the rest"
)
AVX2_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-DSPARKRELAY_AVX2_ONLY"]
ENV = "SPARKRELAY_CPU_KERNELS"
AMX_ENV = "SPARKRELAY_CPU_AMX"
TILE = 32  # output columns per packed tile (cpu_linear.cpp)

_state: dict[str, object] = {}


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _why_not(needed: tuple[str, ...] = NEEDED) -> str:
    """Why a build that needs the CPU flags `needed` cannot be used here, or ""."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    missing = [f for f in needed if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH; install g++)"
    if shutil.which("ninja") is None:
        return "ninja is not on PATH (pip install ninja)"
    return ""


def _build(
    name: str = "sparkrelay_cpu_kernels", sources=SOURCES, flags=FLAGS, folder=None
) -> ModuleType:
    from torch.utils.cpp_extension import load

    folder = BUILD if folder is None else folder
    folder.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder / "build.flock"):
        # torch's own lock file: only a builder killed inside load() leaves one, and torch would wait
        # on it forever; under our lock no other process is inside load(), so one found here is stale
        (folder / "lock").unlink(missing_ok=True)
        return load(
            name=name,
            sources=[str(p) for p in sources],
            extra_include_paths=[str(CSRC)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )


@contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """One process at a time checks or builds the extension: an flock, which the kernel releases when
    its holder dies, so a process killed mid-build never leaves the others waiting."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _attempt(needed: tuple[str, ...], **build) -> tuple[Optional[ModuleType], str]:
    """(the built extension, "") where the CPU has `needed` and the build works, else (None, why)."""
    why = _why_not(needed)
    if why:
        return None, why
    try:
        return _build(**build), ""
    except Exception as e:  # a compile or load failure: the fallback serves
        return None, f"building {CSRC.name}/ failed ({type(e).__name__}: {str(e)[-300:]})"


def load() -> Optional[ModuleType]:
    """The built extension, or None (warned once with the reason and the fallback)."""
    if "module" not in _state:
        module, why = _attempt(NEEDED)
        if why:
            logger.warning("CPU kernels off: %s; %s", why, _fallback_note(why))
        _state["amx"] = bool(module) and module.use_amx(amx_wanted())
        _state["module"], _state["why"] = module, why
    return _state["module"]  # type: ignore[return-value]


def _fallback_note(why: str) -> str:
    """What serves the linears when the AVX-512 build is off for `why`."""
    if why.startswith("this CPU lacks") and not [f for f in AVX2_NEEDED if f not in cpu_flags()]:
        return AVX2_NOTE + " where it builds"
    return "the linears use oneDNN (slower decoding)"


def portable() -> Optional[ModuleType]:
    """The extension with the kernels both builds carry (all but the int8 product and AMX: the bf16
    product behind KernelLinear, the row kernels, the Markov head's greedy block, the bf16 decode
    attention, the layer's element-wise steps and its one-call forward): the AVX-512 build,
    else the AVX2 build (a CPU with avx2 and fma), else None (warned once, with the reason). Why a
    second build: on such a CPU a bf16 model otherwise multiplies through a float32 copy, reading
    twice the bytes per decode step, and torch's argmax and bitmask fill cost several times these
    kernels' in every grammar-constrained or greedy DSpark round."""
    full = load()
    if full is not None or _state["why"] == f"{ENV}=0":
        return full
    if "avx2" not in _state:
        module, why = _attempt(
            AVX2_NEEDED,
            name="sparkrelay_cpu_kernels_avx2",
            sources=AVX2_SOURCES,
            flags=AVX2_FLAGS,
            folder=BUILD / "avx2",
        )
        if why:
            logger.warning("AVX2 kernels off: %s; the linears use oneDNN, the rows torch", why)
        _state["avx2"], _state["avx2_why"] = module, why
    return _state["avx2"]  # type: ignore[return-value]


@contextmanager
def forced_off() -> Iterator[None]:
    """Inside, load() answers None, as with SPARKRELAY_CPU_KERNELS=0: an engine built and run inside
    takes the fallbacks. A benchmark interleaves it with an engine on the kernels in one process,
    where two processes run minutes apart on a shared machine measure the machine's load."""
    portable()
    saved = _state["module"], _state.get("avx2")
    _state["module"] = _state["avx2"] = None
    try:
        yield
    finally:
        _state["module"], _state["avx2"] = saved


def amx_wanted() -> bool:
    """Whether the tile unit may be used (SPARKRELAY_CPU_AMX is not 0)."""
    return os.environ.get(AMX_ENV, "1") != "0"


def amx_on() -> bool:
    """After load(): whether the kernels' products run on AMX."""
    load()
    return bool(_state["amx"])


def why_off() -> str:
    """After load(): why the kernels are off, or ""."""
    load()
    return str(_state["why"])


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> the kernel's bf16 layout, 1-D: [N/32 tiles][K/2 pairs][2][16][2] (N padded
    to 32 and K to even with zeros)."""
    n, k = weight.shape
    n_pad, k_pad = -(-n // TILE) * TILE, k + k % 2
    w = torch.zeros(n_pad, k_pad, dtype=torch.bfloat16)
    w[:n, :k] = weight.detach().to(torch.bfloat16)
    return w.view(n_pad // TILE, 2, 16, k_pad // 2, 2).permute(0, 3, 1, 2, 4).contiguous().view(-1)


def unpack_bf16(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """pack_bf16's inverse: [N, K]."""
    n_pad, k_pad = -(-n // TILE) * TILE, k + k % 2
    w = packed.view(n_pad // TILE, k_pad // 2, 2, 16, 2).permute(0, 2, 3, 1, 4)
    return w.reshape(n_pad, k_pad)[:n, :k].contiguous()


def pad_to_tile(v: torch.Tensor) -> torch.Tensor:
    """[N] -> [N padded to 32] with zeros (the kernels' epilogues read whole tiles)."""
    out = torch.zeros(-(-v.numel() // TILE) * TILE, dtype=v.dtype)
    out[: v.numel()] = v
    return out


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8 -> the kernel's int8 layout, 1-D: [N/32 tiles][K/4 quads][2][16][4] (N padded
    to 32 and K to 4 with zeros)."""
    n, k = q.shape
    n_pad, k_pad = -(-n // TILE) * TILE, -(-k // 4) * 4
    w = torch.zeros(n_pad, k_pad, dtype=torch.int8)
    w[:n, :k] = q
    return w.view(n_pad // TILE, 2, 16, k_pad // 4, 4).permute(0, 3, 1, 2, 4).contiguous().view(-1)


def main() -> None:
    """Set-up's step: build (or find built) and say which path the linears take."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    module = load()
    if module is None:
        avx2 = portable() is not None
        note = AVX2_NOTE if avx2 else "the linears use oneDNN"
        print(f"CPU kernels: off ({why_off()}); {note}", flush=True)
        return
    amx = "on" if amx_on() else "off"
    print(f"CPU kernels: built in {BUILD} (AVX-512 bf16 and int8; AMX {amx})", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
