"""User-facing errors: one clear line, a non-zero exit code, no traceback unless --debug."""

from __future__ import annotations


class RlkitError(Exception):
    """An error caused by the user's input or environment; printed as one line."""

    exit_code = 2


class TruncatedStream(RlkitError):
    """An Arrow stream ended before its producer wrote the end marker (upstream died)."""

    exit_code = 3


class SandboxUnavailable(RlkitError):
    """Untrusted code cannot be sandboxed here (bwrap missing, user namespaces disabled, bwrap failing):
    the line says what is wrong and how to install it, or `--sandbox none` (unsafe)."""

    exit_code = 69  # EX_UNAVAILABLE


class EmptySplit(RlkitError):
    """A data task's split holds no problem (its line says which and how to widen it); exit 2 as any bad input."""


class UntrustedVerifier(RlkitError):
    """A task's verifier pays junk, or sft's targets are answers its verifier rejects (`rlkit.tasks.trust`)."""

    exit_code = 65  # EX_DATAERR


class DownstreamClosed(Exception):  # noqa: N818 (a signal, not a failure)
    """The stage reading our output has ended: in a `--follow` pipe the normal way for a run to end."""


def non_finite_cause(inputs: dict) -> str | None:
    """Why a training step's loss or gradient came out NaN or inf, when its inputs did: the first of
    `inputs` (what to call it -> a tensor with rows first, a model, or None to skip) that holds NaN or
    inf, e.g. "the input table's old_logprobs holds NaN in 3 of 64 rows" or "the starting weights hold
    inf in model.layers.0.mlp.up_proj.weight". None when every input is finite: the step itself
    diverged (a learning rate too high). Reads every input and weight: for the failure path only."""
    for what, x in inputs.items():
        if x is None:
            continue
        if hasattr(x, "named_parameters"):
            bad = [(n, k) for n, p in x.named_parameters() if (k := _non_finite_kind(p))]
            if bad:
                more = f" and {len(bad) - 1} more tensors" if len(bad) > 1 else ""
                return f"{what} hold {bad[0][1]} in {bad[0][0]}{more}"
        elif kind := _non_finite_kind(x):
            x = x.detach()
            rows = int((~x.isfinite()).reshape(len(x), -1).any(1).sum()) if x.dim() else 1
            return f"{what} holds {kind} in {rows} of {len(x) if x.dim() else 1} rows"
    return None


def _non_finite_kind(t) -> str:
    """'NaN', 'inf', 'NaN and inf' or '' for a tensor (this rank's shard of an FSDP2 DTensor)."""
    t = t.detach()
    t = t.to_local() if hasattr(t, "to_local") else t
    if not t.is_floating_point():
        return ""
    found = [k for k, bad in (("NaN", t.isnan().any()), ("inf", t.isinf().any())) if bool(bad)]
    return " and ".join(found)
