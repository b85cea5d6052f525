"""What an EAGLE or EAGLE-3 head's directory says about it (its config and tensor names), read
where the engine's config is checked as well as in the workers that build the head
(zllm/workers/models/llama_eagle.py holds the layouts and the head itself)."""

from __future__ import annotations

from dataclasses import dataclass

from zllm.model_spec import ModelSpec

EAGLE_METHODS = ("eagle", "eagle3")


@dataclass(frozen=True, slots=True)
class EagleSpec:
    """What a head's directory says about it, beside its Llama-shaped layer (`layer`)."""

    method: str
    layer: ModelSpec  # the head's decoder layer (hidden size, heads, MLP, rope, eps)
    target_hidden_size: int  # the width of each target feature fc takes
    draft_vocab_size: int  # EAGLE-3's head's vocabulary (d2t maps it to the target's); else vocab_size
    aux_layer_ids: tuple[int, ...]  # EAGLE-3: the target layers whose input feeds fc
    tensor_names: frozenset[str]  # in the checkpoint: which optional tensors it has

    @property
    def feature_inputs(self) -> int:
        """Target features concatenated into fc: one for EAGLE-1 (beside the embedding), three for EAGLE-3."""
        return 3 if self.method == "eagle3" else 1

    @property
    def own_embeddings(self) -> bool:
        return "embed_tokens.weight" in self.tensor_names

    @property
    def own_lm_head(self) -> bool:
        return self.method == "eagle3" or "lm_head.weight" in self.tensor_names

    @classmethod
    def read(cls, head_dir: str, method: str, target: ModelSpec, with_weights: bool = True) -> EagleSpec:
        """The head's config.json and tensor names (none for random weights: with_weights False);
        refuses a head that cannot feed on `target`."""
        from transformers import AutoConfig

        from zllm.model_files import checkpoint_tensor_names

        hf = AutoConfig.from_pretrained(head_dir)
        hf.architectures = ["LlamaForCausalLM"]  # LlamaForCausalLMEagle3 etc.: the layer is Llama's
        layer = ModelSpec.from_hf_config(hf)
        where = "speculative_config.model"
        if layer.vocab_size != target.vocab_size:
            raise ValueError(
                f"{where}: the head's vocabulary ({layer.vocab_size} tokens) differs from the target's "
                f"({target.vocab_size}); an EAGLE head must be trained for the target"
            )
        target_hidden = int(getattr(hf, "target_hidden_size", None) or layer.hidden_size)
        if target_hidden != target.hidden_size or (method == "eagle" and layer.hidden_size != target.hidden_size):
            raise ValueError(
                f"{where}: the head's hidden size ({layer.hidden_size}, target features {target_hidden}) does not "
                f"match the target's ({target.hidden_size}); an EAGLE head must be trained for the target"
            )
        draft_vocab = int(getattr(hf, "draft_vocab_size", None) or layer.vocab_size) if method == "eagle3" else 0
        if method == "eagle3" and not 1 <= draft_vocab <= layer.vocab_size:
            raise ValueError(f"{where}: draft_vocab_size {draft_vocab} must be 1..{layer.vocab_size}")
        aux = aux_layer_ids(hf, target.num_layers) if method == "eagle3" else ()
        names = frozenset(checkpoint_tensor_names(head_dir, torch_file=True) if with_weights else ())
        if with_weights and method == "eagle3" and draft_vocab < layer.vocab_size and "d2t" not in names:
            raise ValueError(f"{where}: a head with draft_vocab_size {draft_vocab} < vocab_size needs its d2t tensor")
        return cls(method, layer, target_hidden, draft_vocab or layer.vocab_size, aux, names)


def aux_layer_ids(hf_config, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input (the residual stream before them) EAGLE-3 reads: the config's
    eagle_aux_hidden_state_layer_ids (top level or in eagle_config), else vLLM's default
    (2, n // 2, n - 3)."""
    eagle_config = getattr(hf_config, "eagle_config", None) or {}
    ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None) or eagle_config.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    n = num_target_layers
    ids = tuple(int(i) for i in ids) if ids else (2, n // 2, n - 3)
    if len(ids) != 3 or not all(0 < i < n for i in ids):
        raise ValueError(
            f"speculative_config.model: EAGLE-3 reads three target layers in 1..{n - 1}, got {list(ids)} "
            f"(a target of {n} layers)"
        )
    return ids
