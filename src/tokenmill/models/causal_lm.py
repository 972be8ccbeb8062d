"""What every causal LM of this package shares, whatever its decoder layers: the attention
backends of its layers, the output head, and loading Hugging Face-named weights.

Parameter names follow Hugging Face's (``model.layers.N.self_attn...``) except for two
fused projections, filled shard by shard by ``load_weights`` (a checkpoint that stores
them fused, as Phi-3's, fills them whole)::

    qkv_proj.weight rows:     | q_proj (heads*D) | k_proj (kv*D) | v_proj (kv*D) |
    gate_up_proj.weight rows: | gate_proj (I)    | up_proj (I)   |

Attention: one backend per distinct sliding window of the layers (``ModelConfig.
layer_window``), shared by the layers of that window and planned once per forward pass
(``layer_plans``): ``NativeAttention`` where the engine has native kernels (windowed
layers' prefills on SDPA: the prefill kernel has no window), else ``SdpaAttention``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.kernels import NativeKernels
from tokenmill.models.attention.backend import AttentionBackend, AttentionPlan
from tokenmill.models.attention.metadata import AttentionMetadata
from tokenmill.models.attention.native import NativeAttention
from tokenmill.models.attention.sdpa import SdpaAttention
from tokenmill.models.config import ModelConfig
from tokenmill.models.gguf.blocks import DENSE_TYPES, FileRows
from tokenmill.models.gguf.embedding import FileRowsEmbedding
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.ops import layer_ops
from tokenmill.models.weights.formats import PackedWeight, WeightFormat

# Hugging Face projection name -> (our fused projection, shard index in it).
PACKED_WEIGHTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Checkpoint entries that are not weights (precomputed rotary tables in old checkpoints).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class PagedCausalLM(nn.Module):
    """A causal LM over a paged KV cache (one cache tensor per layer). A subclass names its
    ``model_class``, built here as ``self.model`` (``embed_tokens``, ``layers``, ``norm``:
    layer ``i`` with the backend ``self.layer_attentions[i]``), and defines ``run_layers``.

    Built for its kernels: ``kernels`` (the engine's native ones, None: PyTorch's) fix
    its attention backends, ``weight_format`` (``choose_weight_format``'s; None: plain
    weights) its projections' and output head's format; neither changes afterwards."""

    model_class: type[nn.Module]

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 kernels: NativeKernels | None = None,
                 weight_format: WeightFormat | None = None):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.kernels = kernels
        self.layer_attentions = self.attention_backends(config, dtype, kernels)
        self.attentions: list[AttentionBackend] = []  # distinct, planned once per forward
        for backend in self.layer_attentions:
            if all(backend is not a for a in self.attentions):
                self.attentions.append(backend)
        self._plan_of_layer = [next(i for i, a in enumerate(self.attentions) if a is b)
                               for b in self.layer_attentions]
        self.weight_format = weight_format
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, False, dtype, device,
                        None if weight_format is None else weight_format.head)
        )
        self.packed_tied_head: PackedWeight | None = None
        # a tied head's file rows (the embedding's, from a GGUF file), kept for ``pack``
        self._tied_head_rows: FileRows | None = None
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        self._qkv_rows = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
        self.model = self.model_class(config, dtype, device, self.layer_attentions,
                                      layer_ops(kernels), weight_format)

    @staticmethod
    def attention_backends(config: ModelConfig, dtype: torch.dtype,
                           kernels: NativeKernels | None) -> list[AttentionBackend]:
        """Each layer's attention backend (``attention_backends``'s; a family whose
        attention they do not compute builds its own)."""
        return attention_backends(config, dtype, kernels)

    def kv_cache_shape(self, num_blocks: int, block_size: int,
                       int8: bool = False) -> tuple[int, ...]:
        """Shape of one layer's cache tensor: ``[2, num_blocks, block_size, kv_heads, D]``
        (``D + 4`` bytes a row where ``int8``: see ``kv_int8``)."""
        return self.config.kv_cache_shape(num_blocks, block_size, int8)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Hidden states ``[T, H]`` (after the final norm) for the batch's ``T`` new tokens.

        Also writes each layer's new keys/values into ``kv_caches`` at the metadata's slots.
        """
        assert len(kv_caches) == len(self.model.layers), "one KV cache tensor per layer"
        plans = self.layer_plans(attn_metadata, kv_caches[0].shape[1])
        return self.model.norm(self.run_layers(input_ids, positions, kv_caches, plans))

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   kv_caches: list[torch.Tensor], plans: list[AttentionPlan]) -> torch.Tensor:
        """The hidden states after the last decoder layer, before the final norm."""
        raise NotImplementedError

    def layer_plans(self, attn_metadata: AttentionMetadata,
                    num_cache_blocks: int) -> list[AttentionPlan]:
        """Each layer's attention plan, one ``plan`` call per distinct backend (a model
        with one backend, as Llama's, pays no Python call more than that one)."""
        if len(self.attentions) == 1:
            return [self.attentions[0].plan(attn_metadata, num_cache_blocks)] * len(
                self._plan_of_layer)
        plans = [a.plan(attn_metadata, num_cache_blocks) for a in self.attentions]
        return [plans[i] for i in self._plan_of_layer]

    def compute_logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """Logits ``[N, V]`` for the hidden rows ``[N, H]`` to sample from: float32, or with
        ``widen=False`` the output head's own dtype (for a caller that widens only where it
        computes)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self.packed_tied_head is not None:
            logits = self.packed_tied_head(hidden)
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        return logits.float() if widen else logits

    def pack(self) -> None:
        """Convert every projection to the model's weight format (see ``weights.formats``);
        call once, after ``load_weights``. The output head takes the format's ``head``; a
        tied one gets a packed copy of the embedding, which the token lookup still needs
        (from the file's own rows where the embedding was read from a GGUF file's blocks,
        as an untied head's are)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if self.lm_head is None and self.weight_format is not None:
            head, rows = self.weight_format.head, self._tied_head_rows
            if rows is None:
                self.packed_tied_head = head.pack(self.model.embed_tokens.weight.data, None)
            else:  # the values for the shape and dtype alone where the head reads the rows
                embedding = (self.model.embed_tokens.weight.data if not head.reads_file_rows
                             else torch.empty((), dtype=self.dtype).expand(rows.shape))
                self.packed_tied_head = head.pack_rows(embedding, None, [rows])
            self._tied_head_rows = None

    def convert_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The checkpoint tensor ``name`` as its parameter holds it (the identity here; a
        family whose checkpoint stores a weight otherwise converts it)."""
        return tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | FileRows]]) -> None:
        """Copy Hugging Face-named tensors into the parameters (cast to their dtype/device).
        A GGUF file's rows (``FileRows``) are dequantized into the parameter, and a
        projection (``Linear``), or the embedding of a tied output head, also keeps them,
        for its weight format; where that format reads the rows alone
        (``WeightFormat.reads_file_rows``), a projection's parameter is left unwritten
        (never resident) and a quantized embedding looks tokens up in the rows
        (``FileRowsEmbedding``), so no dequantized copy of the file is made.

        Raises ``ModelLoadError`` on an unknown name, a shape mismatch, or when some
        parameter (or shard of a fused one) received no tensor.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        seen: set[str] = set()
        for name, tensor in weights:
            tied_head = self.lm_head is None and name.startswith("lm_head.")
            if tied_head or name.endswith(IGNORED_SUFFIXES):
                continue
            target, shard = _fused_name(name)
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"unexpected weight {name!r} for {self.config.architecture}")
            dst, lo = param.data, 0
            if shard is not None:
                lo, hi = self._shard(target.split(".")[-2], dst.shape[0], shard)
                dst = dst[lo:hi]
            if dst.shape != tensor.shape:
                raise ModelLoadError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            if isinstance(tensor, FileRows):
                module = modules[target.rsplit(".", 1)[0]]
                if isinstance(module, Linear):
                    module.keep_file_rows(lo, tensor)
                    if module.weight_format is not None and module.weight_format.reads_file_rows:
                        seen.add(name)  # packed from the rows alone: nothing to write
                        if module.has_all_file_rows() and module.bias is None:
                            module.pack()  # now, so that the rows are let go of early
                        continue
                elif module is self.model.embed_tokens:
                    if self.lm_head is None:
                        self._tied_head_rows = tensor
                    if self._embeds_file_rows(tensor):
                        self.model.embed_tokens = FileRowsEmbedding(tensor, dst.dtype,
                                                                    dst.device)
                        seen.add(name)
                        continue
                tensor = tensor.dequantize()
            dst.copy_(self.convert_weight(name, tensor))
            seen.add(name)
        missing = sorted(self.expected_weight_names() - seen)
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ModelLoadError(f"missing weights: {', '.join(missing[:3])}{more}")

    def _embeds_file_rows(self, rows: FileRows) -> bool:
        """Whether the embedding looks tokens up in the file's ``rows`` themselves
        (``FileRowsEmbedding``): a quantized type, on the CPU, under a weight format that
        computes on the file's rows."""
        return (self.weight_format is not None and self.weight_format.reads_file_rows
                and rows.qtype not in DENSE_TYPES
                and self.model.embed_tokens.weight.device.type == "cpu")

    def _shard(self, fused: str, rows: int, shard: int) -> tuple[int, int]:
        """The rows of shard ``shard`` of the fused projection ``fused`` (``rows`` rows):
        q, k or v of ``qkv_proj``; a half of ``gate_up_proj``, whatever its MLP's width (a
        mixture's experts are narrower than a dense MLP)."""
        if fused == "qkv_proj":
            return self._qkv_rows[shard]
        half = rows // 2
        return shard * half, (shard + 1) * half

    def expected_weight_names(self) -> set[str]:
        """The Hugging Face names of every tensor ``load_weights`` must receive."""
        if self.config.family.fused_checkpoint:
            return {name for name, _ in self.named_parameters()}
        unfused = {fused: [hf for hf, (f, _) in PACKED_WEIGHTS.items() if f == fused]
                   for fused, _ in PACKED_WEIGHTS.values()}
        names = set()
        for name, _ in self.named_parameters():
            parts = name.split(".")
            for hf in unfused.get(parts[-2], [parts[-2]]):
                names.add(".".join([*parts[:-2], hf, parts[-1]]))
        return names


def attention_backends(config: ModelConfig, dtype: torch.dtype,
                       kernels: NativeKernels | None) -> list[AttentionBackend]:
    """Each layer's backend: one object per distinct window (see the module docstring)."""
    heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    if kernels is None:
        return backends_by_window(config, lambda window: SdpaAttention(
            *heads, dtype, config.attention_scale, window))
    return backends_by_window(config, lambda window: NativeAttention(
        kernels, *heads, dtype, config.attention_scale, window))


def backends_by_window(config: ModelConfig, build: Callable[[int | None], AttentionBackend]
                       ) -> list[AttentionBackend]:
    """Each layer's backend, ``build(window)`` called once per distinct window and the
    object shared by the layers of that window."""
    built: dict[int | None, AttentionBackend] = {}
    for layer in range(config.num_hidden_layers):
        window = config.layer_window(layer)
        if window not in built:
            built[window] = build(window)
    return [built[config.layer_window(i)] for i in range(config.num_hidden_layers)]


def _fused_name(hf_name: str) -> tuple[str, int | None]:
    """``model.layers.3.self_attn.k_proj.weight`` -> (``...qkv_proj.weight``, 1)."""
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in PACKED_WEIGHTS:
        fused, shard = PACKED_WEIGHTS[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), shard
    return hf_name, None
