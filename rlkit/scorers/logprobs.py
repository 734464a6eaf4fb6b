"""Per-token log-prob scorers: the frozen reference's (`ref_logprobs`, pi_ref) and a teacher's
(`teacher_logprobs`, on-policy distillation) log-prob of every completion token, forward-only, length-bucketed
and packed (`score_tokens`), at the rollout's sampling temperature like pi_old, gathered without a second
full-vocabulary tensor (`rlkit.ops.logprobs`). Both read the policy's own token ids, so both must have its
tokenizer exactly (`check_upstream`). `recorded_reference` finds the reference a policy was trained against.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlkit.errors import RlkitError
from rlkit.scorers.base import Rows, Scorer

if TYPE_CHECKING:
    from rlkit.io.manifests import Manifest


def score_batch(model, batch, pad_id: int, temperature: float, batch_tokens: int, packed: bool = True) -> list[list[float]]:
    """Reference log-probs for every row of a rollouts record batch, in row order."""
    return score_tokens(model, batch.column("prompt_ids").to_pylist(), batch.column("completion_ids").to_pylist(),
                        pad_id, temperature, batch_tokens, packed)


def score_tokens(model, prompts: list[list[int]], comps: list[list[int]], pad_id: int, temperature: float,
                 batch_tokens: int, packed: bool = True) -> list[list[float]]:
    """Per-token log-probs of each completion given its prompt, in input order (length-bucketed; each forward
    batch packed without padding unless packed=False, `rlkit.ops.packing`)."""
    import torch

    from rlkit import devices
    from rlkit.io.data import token_batches
    from rlkit.ops.logprobs import completion_logprobs
    from rlkit.ops.packing import layout

    out: list[list[float] | None] = [None] * len(prompts)
    device = devices.model_device(model)
    lengths = [len(p) + len(c) for p, c in zip(prompts, comps, strict=True)]
    for idx in token_batches(lengths, batch_tokens):
        seqs = layout([[*prompts[i], *comps[i]] for i in idx], [len(prompts[i]) for i in idx], packed=packed,
                      pad_id=pad_id)
        with torch.no_grad():
            lp, _ = completion_logprobs(model, seqs.to(device), temperature=temperature)
        lp = lp.cpu()  # one copy to the host per forward batch
        for r, i in enumerate(idx):
            out[i] = lp[r, : len(comps[i])].tolist()
    return out  # type: ignore[return-value]


class LogProbScorer(Scorer):
    """A causal LM's log-prob of every completion token of the rows (`score_batch`), at the rollout's
    temperature (taken from the input's manifest by `check_upstream`)."""

    lm = True

    def __init__(self, path: Path, device=None, dtype: str = "fp32", trust_remote_code: bool = False,
                 batch_tokens: int = 16384, packed: bool = True) -> None:
        self.model_dir, self.device, self.dtype, self.trust_remote_code = Path(path), device, dtype, trust_remote_code
        self.batch_tokens, self.packed = batch_tokens, packed
        self.model = self._tokenizer = self.temperature = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from rlkit.io import checkpoints

            self._tokenizer = checkpoints.load_tokenizer(self.model_dir, self.trust_remote_code)
        return self._tokenizer

    def check_upstream(self, upstream) -> None:
        """Its tokenizer must be the one that sampled the rows (recorded in their manifest); and the rollout's
        temperature is what it scores at."""
        from rlkit.io import checkpoints

        want, self.temperature = upstream.tokenizer, upstream.temperature
        have = checkpoints.tokenizer_fingerprint(self.tokenizer)
        if want and want != have:
            raise RlkitError(f"{self.what} has a different tokenizer from the policy that sampled these rollouts "
                             f"({have} vs {want}); {self.same_tokenizer}")

    def score(self, rows: Rows) -> dict:
        import pyarrow as pa

        from rlkit.io import schemas

        lp_type = schemas.kind("scored").schema().field("ref_logprobs").type
        lp = score_batch(self.model, rows.batch, self.tokenizer.pad_token_id, self.temperature, self.batch_tokens,
                         self.packed)
        return {self.column: pa.array(lp, lp_type)}


class ReferenceScorer(LogProbScorer):
    """The frozen reference (made by `freeze-ref`; its weights' hashes checked now, whatever --no-verify says):
    `ref_logprobs`, the column that makes the table a 'scored' one."""

    column, same_tokenizer = "ref_logprobs", "freeze the reference from the same SFT checkpoint"

    def __init__(self, path: Path, *args, **kwargs) -> None:
        from rlkit.io import checkpoints

        super().__init__(path, *args, **kwargs)
        self.frozen = checkpoints.verify_reference(path)  # reads the files (hashes), puts nothing on the device
        self.what, self.said = f"reference {path}", str(path)

    def fields(self) -> list:
        return []  # ref_logprobs is the 'scored' kind's own column

    def inputs(self) -> dict[str, str]:
        from rlkit.io import fingerprints

        return {"ref": fingerprints.fingerprint(self.model_dir)}

    def manifest_entry(self) -> dict:
        """The entries naming the reference: its path and its weights' digest."""
        return {"reference": self.model_dir, "reference_digest": self.frozen.get("weights_digest")}

    def clash(self, reader) -> str | None:
        if reader.kind == "scored":
            return "the input already has reference log-probs; pass only --rm to add reward-model scores"
        return None

    def load(self) -> None:
        if self.model is None:
            from rlkit.io import checkpoints

            self.model, _, _ = checkpoints.load_reference(self.model_dir, self.device, self.trust_remote_code,
                                                          self.dtype)


class TeacherScorer(LogProbScorer):
    """A teacher for on-policy distillation (`--teacher DIR`, any causal LM directory with the policy's tokenizer):
    `teacher_logprobs`; never the policy that sampled the rows."""

    column = "teacher_logprobs"
    same_tokenizer = ("on-policy distillation compares log-probs of the same token ids, so the teacher's vocabulary "
                      "and special tokens must be the policy's exactly")
    refusal = "distilling a policy from itself trains nothing (teacher_kl 0); use a different teacher checkpoint"

    def __init__(self, path: Path, *args, **kwargs) -> None:
        from rlkit.io import checkpoints, fingerprints

        super().__init__(path, *args, **kwargs)
        checkpoints.check_model_dir(path, "teacher")  # checked (weights' hashes, tokenizer) before anything loads
        self.tokenizer  # noqa: B018 (loaded now: a broken one is one line before any model loads)
        self.fingerprint = fingerprints.fingerprint(path)
        self.what = self.said = f"teacher {path}"
        self.dtype = "fp32" if self.dtype == "stored" else self.dtype

    def fields(self) -> list:
        from rlkit.io import schemas

        return [next(f for f in schemas.TOKEN_FIELDS if f.name == self.column)]

    def inputs(self) -> dict[str, str]:
        return {"teacher": self.fingerprint}

    def manifest_entry(self) -> dict:
        return {"teacher": str(self.model_dir)}

    def clash(self, reader) -> str | None:
        if self.column in reader.schema.names:
            return f"{reader.label} already has teacher log-probs; score it with one teacher"
        return None

    def load(self) -> None:
        if self.model is None:
            from rlkit.io import checkpoints

            self.model = checkpoints.load_teacher(self.model_dir, self.device, self.trust_remote_code, self.dtype)


def recorded_reference(upstream: Manifest) -> tuple[Path, Path]:
    """(the reference, the policy that records it, as the rollout named it) for rollouts sampled by a policy
    `update` trained: its manifest names the reference its input was scored against. The policy is read at the
    path resolved when the rollout ran (this stage may run elsewhere). Checked against the fingerprint recorded
    then; an SFT checkpoint records none: the error says how to make one and pass it."""
    from rlkit.io import checkpoints, fingerprints

    policy = upstream.path(upstream.sampling_section, "policy")
    given = upstream.sampling.get("policy")
    nothing = ("nothing to score with: pass --ref REF (reference log-probs), --rm NAME=DIR, "
               "--reward-fn NAME=FILE.py:FUNC and/or --teacher DIR")
    if not policy or not Path(policy).is_dir():
        raise RlkitError(nothing + " (the input does not name a policy whose reference could be used)")
    entry = (checkpoints.load_manifest(Path(policy)) or {}).get("reference")
    if not isinstance(entry, dict) or not entry.get("path"):
        raise RlkitError(f"{nothing}. The policy that sampled these rollouts, {policy}, records no reference (an SFT "
                         f"checkpoint has none): make one with `rlkit freeze-ref --policy {policy} --out ref/` and pass "
                         "`--ref ref/`")
    ref = Path(entry["path"])
    if not ref.is_dir():
        raise RlkitError(f"{policy} was trained against the reference {ref}, which is not there any more; pass --ref REF")
    if entry.get("fingerprint") and fingerprints.fingerprint(ref) != entry["fingerprint"]:
        raise RlkitError(f"the reference {ref} has changed since {policy} was trained against it; pass --ref REF")
    return ref, Path(given if isinstance(given, str) else policy)
