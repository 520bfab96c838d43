"""The Llama family: Llama 1/2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM.

One definition covers them all; the differences are config flags. The model works on a flat batch
of tokens (decodes first, then prefill chunks) and a paged KV cache bound per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine import kernels
from engine.config import ModelConfig
from engine.kernels.float_matmul import rounds_rows
from engine.kernels.gemm import gemm_native, pack_panels
from engine.layers.attention import PagedAttention
from engine.layers.attention_metadata import AttentionMetadata
from engine.layers.linear import Linear, pack_bf16, packed_linear
from engine.layers.mlp import GatedMLP
from engine.layers.native_decode import MAX_ROWS as NATIVE_DECODE_MAX_ROWS
from engine.layers.native_decode import NativeDecoder
from engine.layers.quant import int8_linear, quantize_int8
from engine.layers.rmsnorm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.pipeline_stage import WHOLE_MODEL, PipelineStage

LayerHook = Callable[[int], None]

# 16-bit logits carry ~3 significant digits (a logit of 20 is off by up to 0.06). The candidates
# that sampling can realistically pick are recomputed in float32 from the same weights.
LOGIT_REFINE_TOPK = 64


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype, device) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = rotary
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_size, self.kv_size = hq * d, hkv * d
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, dtype, device
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, dtype, device)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.attn = PagedAttention(hq, hkv, d)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.pre_attention(positions, hidden)
        o = self.attn(q, k, v, meta)
        return self.post_attention(hidden, o)

    # The dense parts around the attention: the model runner may torch.compile these two (the
    # attention itself has data-dependent shapes and stays eager).
    def pre_attention(
        self, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        t = hidden.shape[0]
        x = self.input_layernorm(hidden)
        qkv = self.qkv_proj(x)
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        v = qkv[:, self.q_size + self.kv_size :].view(t, hkv, d)
        if cfg.qk_norm:
            q = self.q_norm(qkv[:, : self.q_size].view(t, hq, d))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, hkv, d))
            q, k = self.rotary(positions, q, k)
            return q, k, v
        # q and k lie side by side in the fused output: one rotary pass over both heads.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, hq + hkv, d)
        qk = self.rotary.rotate(positions, qk)
        return qk[:, :hq], qk[:, hq:], v

    def post_attention(self, hidden: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.o_proj(o.reshape(hidden.shape[0], self.q_size))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(torch.nn.Module):
    """The whole model, or one stage of a chunked pipeline (``stage``, see
    engine/pipeline_stage.py): the layers of ``stage.layer_range(cfg.num_layers)``
    (``self.layers[i]`` is global layer ``self.layer_range[i]``), the embedding on the first stage
    (and on the last when the LM head is tied to it), the final norm and the LM head on the last.
    What a stage lacks is None. ``cfg`` stays the whole model's config."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        stage: PipelineStage = WHOLE_MODEL,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.stage = stage
        self.layer_range = stage.layer_range(cfg.num_layers)

        def matrix() -> torch.nn.Parameter:
            return torch.nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), False
            )

        has_embedding = stage.is_first or (stage.is_last and cfg.tie_word_embeddings)
        self.embed_tokens: torch.nn.Parameter | None = matrix() if has_embedding else None
        rotary = RotaryEmbedding(
            cfg.head_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
            device,
        )
        self.rotary = rotary
        self.layers = torch.nn.ModuleList(
            DecoderLayer(cfg, rotary, dtype, device) for _ in self.layer_range
        )
        self.norm: RMSNorm | None = None
        self.lm_head: torch.nn.Parameter | None = None
        if stage.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
            self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else matrix()
        self.dtype = dtype
        self.lm_qweight: torch.Tensor | None = None  # int8 LM head (quantize_int8_)
        self.lm_scales: torch.Tensor | None = None
        self.lm_packed: torch.Tensor | None = None  # oneDNN-packed bf16 LM head (pack_weights_)
        self.native_decode = False  # small decode steps by the C layers (enable_native_decode)
        self.deterministic = False  # every step by the C layers (enable_native_decode)
        self._native: NativeDecoder | None = None  # bound to the weights and cache as they are
        self.lm_panels: torch.Tensor | None = None  # the LM head packed for kernels/gemm.py

    @property
    def device(self) -> torch.device:
        return self.layers[0].input_layernorm.weight.device

    def enable_native_decode(self, deterministic: bool = False) -> bool:
        """Run decode-only steps of up to NATIVE_DECODE_MAX_ROWS sequences through the C decoder
        layers (layers/native_decode.py) where they apply and pay; ``deterministic``: every step
        (prefill chunks, mixed steps, any batch) and the final norm and LM head too, so that a
        row's logits never depend on the rows beside it (EngineConfig.deterministic; not with
        int8 weights, whose prefill stays torch's). They apply to a model on the CPU whose C
        kernels build here, with int8 or W8A8 weights (quantize_ first) on any CPU, with float32,
        bf16 or fp16 weights where the C row dots have their AVX-512 or AVX2 paths (cpu_isa:
        without them the row dots are plain loops, and a bf16 decode step took 64 ms against the
        torch layers' 24 ms; float32 at 1 x 512 under ENGINE_CPU_ISA=avx2 took 50 against 116 ms
        with them, see docs/cpu.md). ENGINE_KERNELS=torch turns them off at any time. A
        pipeline stage short of the whole model only prefills: it takes them when deterministic
        (so that its KV and hidden states are the colocated engine's bits), else never.
        Returns whether they are on."""
        from engine import cpu_isa

        int8 = self.lm_qweight is not None
        w8a8 = any(layer.qkv_proj.q8 is not None for layer in self.layers)
        self.native_decode = (
            (self.stage.is_whole or deterministic)
            and self.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and self.device.type == "cpu"
            # int8 and W8A8 weights: the torch layers would call the same C kernels
            and (int8 or w8a8 or cpu_isa.this_cpu().c_float_row_dots)
            and kernels.use_native(self.device)
            # bf16 weights under float32 activations: not where the int8-free row dots are
            # AVX512-BF16's, which round the rows to bf16 (kernels/float_matmul.py rounds_rows);
            # the fixed-order GEMM widens them exactly
            and (deterministic or not rounds_rows(self.weight_dtype, self.dtype))
        )
        self.deterministic = self.native_decode and deterministic and not int8
        self._native = self.lm_panels = None
        return self.native_decode

    def _native_decoder(self, meta: AttentionMetadata, rows: int) -> NativeDecoder | None:
        if not self.native_decode or rows == 0 or not kernels.use_native(self.device):
            return None
        if not self.deterministic and (
            rows > NATIVE_DECODE_MAX_ROWS
            or meta.has_prefill
            or meta.num_decode_tokens != rows
            or not self.stage.is_whole
        ):
            return None
        if self._native is None:
            from engine.kernels import native

            self._native = NativeDecoder(self, native.library(), native.DTYPE_CODES)
        return self._native

    @torch.no_grad()
    def pack_weights_(self) -> bool:
        """bf16 on the CPU: every projection and the LM head's GEMM also get a copy in oneDNN's
        blocked layout (linear.pack_bf16; same results, bit for bit). The plain weights stay:
        the weight cache, the KV pool's model digest and the float32 logit refinement read
        them. Returns whether anything was packed."""
        packed = False
        for layer in self.layers:
            for lin in (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                packed |= lin.pack_()
        if self.lm_head is not None:
            self.lm_packed = pack_bf16(self.lm_head)
        return packed or self.lm_packed is not None

    @torch.no_grad()
    def store_weights_(self, dtype: torch.dtype) -> None:
        """Keep every projection's weight and the embedding / LM head in ``dtype`` (bf16 or fp16)
        while activations, norms, biases and the KV cache stay in the model's dtype (float32):
        EngineConfig.weight_dtype. Products are of the stored weights, exact in float32 (the C
        row dots widen them in registers, torch's GEMMs a tile at a time), so a decode step
        streams half the bytes of float32 weights. Before binding a KV pool: the pool's model
        digest hashes the weights as held."""
        if dtype == self.dtype:
            return
        if self.dtype != torch.float32 or dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"weight_dtype: 16-bit weights take float32 activations, not {self.dtype} "
                f"with {dtype} weights"
            )
        for layer in self.layers:
            for lin in (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lin.store_weight_(dtype)
        tied = self.lm_head is not None and self.lm_head is self.embed_tokens
        if self.embed_tokens is not None:
            self.embed_tokens = torch.nn.Parameter(self.embed_tokens.data.to(dtype), False)
        if tied:
            self.lm_head = self.embed_tokens
        elif self.lm_head is not None:
            self.lm_head = torch.nn.Parameter(self.lm_head.data.to(dtype), False)
        self._native = self.lm_panels = None

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the projections' float weights are held in (store_weights_), or the model's."""
        for layer in self.layers:
            w = layer.qkv_proj.weight
            return self.dtype if w is None else w.dtype
        return self.dtype

    @torch.no_grad()
    def quantize_int8_(self) -> None:
        """Weight-only int8 for every projection and the LM head's GEMM. The 16-bit LM head stays
        in memory (it is the embedding table when tied): each step gathers from it only the rows
        of the top candidates, recomputed in float32 (see compute_logits), which recovers most of
        what int8 costs in top-1 agreement for a few KB read per token. Any model dtype: the
        activations stay in it, and so do the scales (float32 ones for a float32 model). Once:
        a model already quantized is left as it is."""
        if any(layer.qkv_proj.qweight is not None for layer in self.layers):
            return
        for layer in self.layers:
            for lin in (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lin.quantize_int8_()
        if self.lm_head is not None:
            self.lm_qweight, self.lm_scales = quantize_int8(self.lm_head, self.dtype)
        self._native = self.lm_panels = None

    @torch.no_grad()
    def quantize_w8a8_(self) -> None:
        """W8A8 (kernels/gemm_q8.py) for every projection: 8-bit weights and, as each GEMM runs,
        7-bit activations, a float32 scale per block of 32 on both sides, integer products. The
        LM head stays float (the deterministic step's float32 GEMM), as do norms, rotary, the
        attention and the KV cache (its own --kv-cache-dtype). CPU only. Once."""
        if self.device.type != "cpu":
            raise ValueError(f"quantization w8a8 runs on the CPU only, not {self.device}")
        if any(layer.qkv_proj.q8 is not None for layer in self.layers):
            return
        for layer in self.layers:
            for lin in (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lin.quantize_w8a8_()
        self._native = self.lm_panels = None

    def quantize_(self, quantization: str | None) -> None:
        """EngineConfig.quantization: None, "int8" (quantize_int8_) or "w8a8" (quantize_w8a8_)."""
        if quantization == "int8":
            self.quantize_int8_()
        elif quantization == "w8a8":
            self.quantize_w8a8_()
        elif quantization is not None:
            raise ValueError(f"quantization must be None, int8 or w8a8, got {quantization!r}")

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """kv_cache: [num_layers, 2, num_blocks, block_size, Hkv, D], num_layers the layers this
        module holds (a stage's own: its kv_cache[i] is global layer layer_range[i]); each layer
        gets its views."""
        if kv_cache.shape[0] != len(self.layers):
            raise ValueError(
                f"bind_kv_cache: the cache has {kv_cache.shape[0]} layers, this "
                f"{'model' if self.stage.is_whole else f'stage ({self.stage})'} holds "
                f"{len(self.layers)}"
            )
        for i, layer in enumerate(self.layers):
            layer.attn.bind_cache(kv_cache[i, 0], kv_cache[i, 1])
        self._native = self.lm_panels = None

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        layer_hook: LayerHook | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns final hidden states [T, hidden] (normed). ``layer_hook(i)`` runs after global
        layer i wrote its KV (the cluster streams that layer's KV from there).

        A pipeline stage: the first takes ``input_ids``, every other one ``hidden`` (the stage
        before's output for the same tokens, [T, hidden]) and ``input_ids=None``; a stage short of
        the last returns its last layer's output un-normed, for the next stage."""
        if self.stage.is_first:
            if input_ids is None or hidden is not None:
                raise ValueError(
                    f"stage {self.stage} embeds the tokens: pass input_ids, not hidden states"
                )
            assert self.embed_tokens is not None
            hidden = self.embed_tokens[input_ids].to(self.dtype)
        elif input_ids is not None or hidden is None:
            raise ValueError(
                f"stage {self.stage} starts at layer {self.layer_range.start}: pass the hidden "
                "states of the stage before (hidden=...), not input_ids"
            )
        native = self._native_decoder(meta, hidden.shape[0])
        if native is not None:
            hidden = native.run(hidden.contiguous(), positions, meta, layer_hook)
            if self.norm is None:  # a pipeline stage short of the last
                return hidden
            if self.deterministic:
                return native.norm(hidden, self.norm.weight, self.norm.eps)
            return self.norm(hidden)
        for i, layer in zip(self.layer_range, self.layers, strict=True):
            hidden = layer(positions, hidden, meta)
            if layer_hook is not None:
                layer_hook(i)
        return hidden if self.norm is None else self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [S, V]. For 16-bit models and int8 LM heads (float32 models too) the
        GEMM runs at lower precision and the top LOGIT_REFINE_TOPK logits of each row are
        recomputed in float32 from the kept float LM head. Only the last pipeline stage has it."""
        if self.lm_head is None:
            raise ValueError(f"stage {self.stage} has no LM head: the last stage computes logits")
        if self.deterministic and hidden.device.type == "cpu" and kernels.use_native(hidden.device):
            # the fixed-order GEMM: float32 sums of exact products, one order per logit
            if self.lm_panels is None:
                self.lm_panels = pack_panels(self.lm_head.detach())
            return gemm_native(hidden.contiguous(), self.lm_panels, self.lm_head.shape[0])
        if self.lm_qweight is not None:
            logits = int8_linear(hidden, self.lm_qweight, self.lm_scales, None).float()
        elif self.lm_packed is not None and hidden.dtype == torch.bfloat16:
            logits = packed_linear(hidden, self.lm_packed, None).float()
        elif hidden.dtype == torch.float32:  # float32 or 16-bit weights (store_weights_)
            logits = kernels.float_matmul(hidden, self.lm_head)  # C for a few rows on the CPU
        else:
            logits = torch.nn.functional.linear(hidden, self.lm_head).float()
        if (self.dtype == torch.float32 and self.lm_qweight is None) or hidden.shape[0] == 0:
            return logits
        k = min(LOGIT_REFINE_TOPK, logits.shape[-1])
        idx = logits.topk(k, dim=-1).indices  # [S, k]
        rows = self.lm_head[idx].float()  # [S, k, H]
        exact = torch.bmm(rows, hidden.float()[:, :, None])[..., 0]
        return logits.scatter_(1, idx, exact)

    def runtime_weights(self) -> dict[str, torch.Tensor]:
        """The weights as this module holds them (fused, in its dtype), by parameter name with
        global layer numbers (a stage's ``layers.0`` is ``layers.{layer_range.start}``, so a
        stage's weights are the whole model's under the same names); a tied LM head appears
        once, as embed_tokens. What the weight cache stores."""
        return {self._global_name(name): p.data for name, p in self.named_parameters()}

    def _global_name(self, name: str) -> str:
        if not name.startswith("layers.") or self.layer_range.start == 0:
            return name
        _, local, rest = name.split(".", 2)
        return f"layers.{self.layer_range[int(local)]}.{rest}"

    @torch.no_grad()
    def adopt_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Take ``runtime_weights()``-shaped tensors as this module's own, without copying on
        the same device (memory-mapped ones stay mapped). A tied LM head follows the embedding:
        it is the same Parameter."""
        params = {self._global_name(name): p for name, p in self.named_parameters()}
        if set(weights) != set(params):
            odd = sorted(set(weights) ^ set(params))
            raise ValueError(f"adopt_weights: names differ from the model's, e.g. {odd[0]!r}")
        for name, p in params.items():
            t = weights[name]
            if t.shape != p.shape or t.dtype != p.dtype:
                raise ValueError(
                    f"adopt_weights: {name} is {t.dtype} {list(t.shape)}, "
                    f"expected {p.dtype} {list(p.shape)}"
                )
            p.data = t.to(p.device)
        self._native = self.lm_panels = None

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor], source: str = "") -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up: those this module holds
        (a stage's: see loader.stage_weight_names); others are ignored. Missing or misshapen
        tensors raise ValueError naming the tensor and the file."""
        cfg = self.cfg

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"{source}: missing tensor {name!r}")
            return weights[name]

        def put(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(
                    f"{source}: tensor {name!r} has shape {tuple(src.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(src)

        if self.embed_tokens is not None:
            put(self.embed_tokens, get("model.embed_tokens.weight"), "model.embed_tokens.weight")
        if self.lm_head is not None and not cfg.tie_word_embeddings:
            put(self.lm_head, get("lm_head.weight"), "lm_head.weight")
        if self.norm is not None:
            put(self.norm.weight, get("model.norm.weight"), "model.norm.weight")
        for i, layer in zip(self.layer_range, self.layers, strict=True):
            p = f"model.layers.{i}."
            for name, dst in (
                ("input_layernorm.weight", layer.input_layernorm.weight),
                ("post_attention_layernorm.weight", layer.post_attention_layernorm.weight),
                ("self_attn.o_proj.weight", layer.o_proj.weight),
                ("mlp.down_proj.weight", layer.mlp.down_proj.weight),
            ):
                put(dst, get(p + name), p + name)
            sizes = [layer.q_size, layer.kv_size, layer.kv_size]
            for dst, x in zip(layer.qkv_proj.weight.split(sizes), "qkv"):
                put(dst, get(p + f"self_attn.{x}_proj.weight"), p + f"self_attn.{x}_proj.weight")
            if cfg.attention_bias:
                for dst, x in zip(layer.qkv_proj.bias.split(sizes), "qkv"):
                    put(dst, get(p + f"self_attn.{x}_proj.bias"), p + f"self_attn.{x}_proj.bias")
            if cfg.qk_norm:
                put(layer.q_norm.weight, get(p + "self_attn.q_norm.weight"), p + "q_norm")
                put(layer.k_norm.weight, get(p + "self_attn.k_norm.weight"), p + "k_norm")
            halves = layer.mlp.gate_up_proj.weight.split(cfg.intermediate_size)
            for dst, x in zip(halves, ("gate", "up")):
                put(dst, get(p + f"mlp.{x}_proj.weight"), p + f"mlp.{x}_proj.weight")
