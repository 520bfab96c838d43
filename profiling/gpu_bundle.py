"""What a lent GPU machine needs and cannot download: Python wheels and a small model, in one
folder to carry there (the machine reaches no package index and no model hub).

    .venv/bin/python profiling/gpu_bundle.py            # writes profiling/gpu_bundle/ (~55 MiB)

``wheels/``: the engine's runtime dependencies that a CUDA image with torch and Triton usually
lacks (tokenizers, safetensors, gguf, pyzmq, msgpack, xxhash, ...; the versions of
constraints.txt), as binary wheels for CPython 3.10 to 3.13 on x86_64 Linux, since that machine's
Python is not known in advance. ``profiling/gpu_check.sh`` installs from there, without an index,
only what its Python cannot import, into ``gpu_bundle/site`` (its own site-packages are left as
they are). Needs the package index, so run it here, on the development machine.

``model/``: a small Llama in Hugging Face format (safetensors, bf16, tied embeddings) with
SmolLM2's real tokenizer and chat template: 4 layers, hidden 256, 4 query heads and 2 KV heads of
head_dim 64 (SmolLM2's head_dim and GQA group), 49,152-token vocabulary; about 27 MB. Random
weights: it checks kernels and plumbing (tokens against the torch references, 1P+1D against
colocated), not answers. The default model (a 98 MB GGUF) does not fit in what a run can carry
(64 MiB); gpu_check.sh runs it too where the machine has it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / "profiling" / "gpu_bundle"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
# What `import engine` and a worker process import beyond torch, triton and numpy (which a CUDA
# image has), and pytest; the HTTP server's packages are not needed (the check drives the router
# in-process).
PACKAGES = (
    "gguf",
    "pyyaml",
    "jinja2",
    "markupsafe",
    "msgpack",
    "nvidia-ml-py",
    "safetensors",
    "sentencepiece",
    "tokenizers",
    "tqdm",
    "xxhash",
    "pyzmq",
    "psutil",
    # pytest, for the tests that need a GPU (gpu_check.sh's step 3)
    "pytest",
    "pluggy",
    "iniconfig",
    "packaging",
    "exceptiongroup",
    "tomli",
)
MODEL = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def download_wheels(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for version in PYTHONS:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--no-deps"]
        cmd += ["--python-version", version, "-d", str(dest), "-c", str(ROOT / "constraints.txt")]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        subprocess.run(cmd + list(PACKAGES), check=True)


def write_model(dest: Path, seed: int = 0) -> None:
    """The small Llama of the module docstring, written without transformers."""
    from engine.model.gguf_loader import read_gguf
    from engine.model.loader import resolve_model_path
    from engine.model.tokenizer import tokenizer_from_gguf

    meta, _ = read_gguf(resolve_model_path("default"))
    tokenizer = tokenizer_from_gguf(meta)
    vocab = tokenizer.vocab_size
    h, inter = MODEL["hidden_size"], MODEL["intermediate_size"]
    heads, kv_heads = MODEL["num_attention_heads"], MODEL["num_key_value_heads"]
    dim = h // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    # Tied: the LM head's logits have std about 0.2 * sqrt(h) = 3.2, peaked like a real model's
    # (prompt logprobs mostly -5 to -15) rather than flat (near-ties everywhere).
    tensors = {"model.embed_tokens.weight": rand(vocab, h, std=0.2)}
    tensors["model.norm.weight"] = (1 + rand(h, std=0.1).float()).to(torch.bfloat16)
    for i in range(MODEL["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = (1 + rand(h, std=0.1).float()).bfloat16()
        tensors[p + "post_attention_layernorm.weight"] = (1 + rand(h, std=0.1).float()).bfloat16()
        tensors[p + "self_attn.q_proj.weight"] = rand(heads * dim, h, std=h**-0.5)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_heads * dim, h, std=h**-0.5)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_heads * dim, h, std=h**-0.5)
        tensors[p + "self_attn.o_proj.weight"] = rand(h, heads * dim, std=(heads * dim) ** -0.5)
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, h, std=h**-0.5)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, h, std=h**-0.5)
        tensors[p + "mlp.down_proj.weight"] = rand(h, inter, std=inter**-0.5)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **MODEL,
        "vocab_size": vocab,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.backend.save(str(dest / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "model_max_length": MODEL["max_position_embeddings"],
        "chat_template": tokenizer.chat_template,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=BUNDLE, help=f"default {BUNDLE}")
    parser.add_argument("--no-wheels", action="store_true", help="the model only")
    args = parser.parse_args(argv)
    if (args.out / "model").exists():
        shutil.rmtree(args.out / "model")
    write_model(args.out / "model")
    if not args.no_wheels:
        download_wheels(args.out / "wheels")
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out} ({size / 2**20:.1f} MiB; a run carries at most 64 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
