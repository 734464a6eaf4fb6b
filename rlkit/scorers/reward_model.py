"""Reward models: a scalar head on the hidden state of the last non-pad token of prompt + response,
stored as a plain Hugging Face `AutoModelForSequenceClassification` (num_labels=1).

The forward-only scorer pattern shared with the reference (`score-ref`): load once, hash-check,
score batches sorted by length, return scores in input order. A reward model reads *text*: it
re-tokenizes prompt + response with its own tokenizer, so it may use a different tokenizer from
the policy's (the reference may not: it scores the policy's own token ids). `RewardModelScorer` is one as
score-ref's scorer (`--rm NAME=DIR` -> `reward/rm:NAME`, `parse_rms`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlkit.errors import RlkitError
from rlkit.scorers.base import Rows, Scorer


def load_reward_model(src: str | Path, trust_remote_code: bool = False, num_labels_check: bool = True, device=None,
                      dtype: str = "fp32"):
    """(model, tokenizer) in eval mode with requires_grad off, on `device` (default the CPU), its weights in
    `dtype` (fp32, bf16, fp16: cast on the host before the move); the config's pad id matches the tokenizer's."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from rlkit.devices import TORCH_DTYPES
    from rlkit.io import adapters, checkpoints

    checkpoints.check_model_dir(Path(src), "reward model")
    checkpoints.quiet_transformers()
    if adapters.is_adapter_dir(src):  # a LoRA reward model: merged into its hash-verified base
        if num_labels_check and adapters.kind_of(Path(src)) != "seq-cls":
            raise RlkitError(f"{src} is a LoRA policy, not a reward model; make one with `rlkit train-rm`")
        model = adapters.load(src, "seq-cls", merged=True, trust_remote_code=trust_remote_code)
    else:
        cfg = AutoConfig.from_pretrained(str(src), trust_remote_code=trust_remote_code)
        if num_labels_check and getattr(cfg, "num_labels", None) != 1:
            raise RlkitError(f"{src} is not a reward model (num_labels={getattr(cfg, 'num_labels', None)}); "
                             "make one with `rlkit train-rm`")
        model = AutoModelForSequenceClassification.from_pretrained(
            str(src), dtype=torch.float32, trust_remote_code=trust_remote_code, use_safetensors=True)
    checkpoints.check_finite(model, src, "reward model")
    if dtype != "fp32":
        model.to(getattr(torch, TORCH_DTYPES[dtype]))
    tok = checkpoints.load_tokenizer(src, trust_remote_code)
    model.config.pad_token_id = tok.pad_token_id
    model.eval()
    model.requires_grad_(False)
    if device is not None:
        model.to(device)
    return model, tok


def encode_pairs(tokenizer, prompts: Sequence[str], responses: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids of prompt + response (the tokenizer's special tokens added), cut to the last `max_length`."""
    from rlkit.io.data import encode_texts

    ids = encode_texts(tokenizer, [p + r for p, r in zip(prompts, responses, strict=True)])
    return [x[-max_length:] for x in ids]


def forward_scores(model, ids: Sequence[Sequence[int]], pad_id: int, packed: bool = True):
    """Scores (B,) float32 for a batch of token-id lists: the score head at each sequence's last token, the
    sequences packed into rows without padding (`rlkit.ops.packing`; packed=False: right-padded rows); keeps
    the autograd graph."""
    from rlkit import devices
    from rlkit.ops.packing import layout

    return seq_scores(model, layout(ids, [len(x) for x in ids], packed=packed, pad_id=pad_id).to(devices.model_device(model)))


def seq_scores(model, seqs):
    """Scores (r,) float32 of laid-out sequences `seqs` (`rlkit.ops.packing.Seqs`, on the model's device)."""
    root = getattr(model, "_rlkit_fsdp_root", None)
    if root is not None:  # FSDP2 (train-rm under torchrun): through the root unit, fn = seq_scores_local
        return root(seqs)
    return seq_scores_local(model, seqs)


def seq_scores_local(model, seqs):
    from rlkit.ops.logprobs import hidden_states

    return model.score(hidden_states(model, seqs)[seqs.last]).squeeze(-1).float()


def score_texts(model, tokenizer, prompts: Sequence[str], responses: Sequence[str], batch_tokens: int = 16384,
                max_length: int = 1024, packed: bool = True) -> list[float]:
    """Reward-model scores of prompt + response, in input order (batches sorted by length; packed unless
    packed=False)."""
    import torch

    ids = encode_pairs(tokenizer, prompts, responses, max_length)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = [0.0] * len(ids)
    s = 0
    with torch.no_grad():
        while s < len(order):
            e = s + 1
            while e < len(order) and (e - s + 1) * len(ids[order[e]]) <= batch_tokens:
                e += 1
            batch = order[s:e]
            for i, v in zip(batch, forward_scores(model, [ids[i] for i in batch], tokenizer.pad_token_id, packed).cpu().tolist(),
                            strict=True):
                out[i] = v
            s = e
    return out


def parse_rms(specs: Sequence[str]) -> dict[str, Path]:
    """`--rm NAME=DIR` (or `--rm DIR`, named after the folder) -> {component name: dir}."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, eq, d = spec.partition("=")
        name, path = (name.strip(), Path(d)) if eq else (Path(spec).name, Path(spec))
        if not name or not str(path):
            raise RlkitError(f"--rm {spec!r}: expected NAME=DIR or DIR")
        key = f"rm:{name}"
        if key in out:
            raise RlkitError(f"--rm names {name!r} twice; give each reward model its own NAME=DIR")
        out[key] = path
    return out


class RewardModelScorer(Scorer):
    """A --rm as score-ref's scorer: `reward/rm:NAME`, the reward model's score of each row's prompt + its text
    (under its reading), loaded in `dtype` (stored: fp32, as train-rm stores it) when the first batch comes."""

    kind = "reward model"

    def __init__(self, name: str, path: Path, device=None, dtype: str = "fp32", trust_remote_code: bool = False,
                 batch_tokens: int = 16384, packed: bool = True) -> None:
        from rlkit.io import checkpoints

        checkpoints.check_model_dir(path, "reward model")
        self.name, self.column, self.model_dir = name, f"reward/{name}", Path(path)
        self.said = f"{name} ({path})"
        self.device, self.dtype, self.trust_remote_code = device, "fp32" if dtype == "stored" else dtype, trust_remote_code
        self.batch_tokens, self.packed = batch_tokens, packed
        self.model = self.tokenizer = None

    def inputs(self) -> dict[str, str]:
        from rlkit.io import fingerprints

        return {self.name: fingerprints.fingerprint(self.model_dir)}

    def manifest_entry(self) -> dict:
        return {"reward_models": {self.name: str(self.model_dir)}}

    def load(self) -> None:
        if self.model is None:
            self.model, self.tokenizer = load_reward_model(self.model_dir, self.trust_remote_code, device=self.device,
                                                           dtype=self.dtype)

    def score(self, rows: Rows) -> dict:
        import pyarrow as pa

        texts = rows.texts(self.reads)

        def rm_score(keep):
            return score_texts(self.model, self.tokenizer, [rows.prompts[i] for i in keep], [texts[i] for i in keep],
                               self.batch_tokens, packed=self.packed)

        return {self.column: pa.array(rows.kept(rm_score), pa.float64())}
