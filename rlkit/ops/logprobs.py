"""Per-token log-probs, memory-lean: gather the sampled token's log-prob without a second
full-vocabulary tensor.

`log_softmax(logits).gather(targets)` allocates another (B, T, V) tensor; at a 150k vocabulary that
doubles peak memory. Here each chunk of positions computes `logit[target] - logsumexp(logits)`, so the
only full-vocabulary temporaries are (B, chunk, V).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rlkit.ops.packing import Seqs


def gather_logprobs(logits: Tensor, targets: Tensor, chunk: int = 32, temperature: float = 1.0,
                    with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """log pi(target) per position and optionally the entropy of pi.

    logits (B, T, V) any float dtype; targets (B, T) long -> (B, T) float32 (and (B, T) float32).
    Differentiable. `temperature` divides the logits first (the sampling distribution).
    Logits that need a gradient go through `_TokenLogprob`, which keeps only the logits themselves for
    backward and writes the gradient into their storage: no second (B, T, V) tensor exists at any point
    (autograd over chunks would make one per chunk, and upcasting half-precision logits a third, fp32 one).
    """
    if logits.requires_grad and torch.is_grad_enabled():
        lp = _TokenLogprob.apply(logits, targets, temperature, chunk)
        if not with_entropy:
            return lp, None
        with torch.no_grad():
            return lp, gather_logprobs(logits.detach(), targets, chunk, temperature, True)[1]
    B, T, _ = logits.shape
    outs, ents = [], []
    for s in range(0, T, chunk):
        lg = logits[:, s : s + chunk].float()
        if temperature != 1.0:
            lg = lg / temperature
        lse = torch.logsumexp(lg, dim=-1)
        outs.append(lg.gather(-1, targets[:, s : s + chunk].unsqueeze(-1)).squeeze(-1) - lse)
        if with_entropy:
            with torch.no_grad():
                p = torch.softmax(lg, dim=-1)
                ents.append(lse - (p * lg).sum(-1))
    lp = torch.cat(outs, dim=1) if outs else logits.new_zeros((B, 0), dtype=torch.float32)
    return lp, (torch.cat(ents, dim=1) if with_entropy and ents else None)


class _TokenLogprob(torch.autograd.Function):
    """log softmax(logits / temperature)[target] per position, in fp32, saving only the logits and the
    (B, T) log-normalisers; backward recomputes the softmax chunk by chunk,
    d lp / d logits = (onehot(target) - softmax) / temperature, and writes it over the logits themselves
    (nothing else reads them after the loss: the output head's backward needs its input and weight, not
    its output), so the gradient costs no second full-vocabulary tensor. Autograd's version counter
    still guards the reuse: another node that saved the same logits would fail loudly, never read
    gradients as logits."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk: int) -> Tensor:
        outs, lses = [], []
        for s in range(0, logits.shape[1], chunk):
            lg = logits[:, s : s + chunk].float() / temperature
            lse = torch.logsumexp(lg, dim=-1)
            outs.append(lg.gather(-1, targets[:, s : s + chunk].unsqueeze(-1)).squeeze(-1) - lse)
            lses.append(lse)
        B, T = targets.shape
        lse = torch.cat(lses, 1) if lses else logits.new_zeros((B, 0), dtype=torch.float32)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return torch.cat(outs, 1) if outs else logits.new_zeros((B, 0), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, targets, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        # the gradient is written over the logits, chunk by chunk (see the class docstring); in fp32 at
        # temperature 1 every operation is in place on the logits themselves: no temporary at all
        for s in range(0, logits.shape[1], chunk):
            sl = slice(s, s + chunk)
            d = logits[:, sl].float()  # the logits' own storage in fp32, a chunk's copy in half precision
            if t != 1.0:
                d = d / t
            g = grad[:, sl].unsqueeze(-1)
            d.sub_(lse[:, sl].unsqueeze(-1)).exp_().mul_(-g)  # -softmax * grad
            d.scatter_add_(-1, targets[:, sl].unsqueeze(-1), g)
            if t != 1.0:
                d.div_(t)
            if d.data_ptr() != logits[:, sl].data_ptr():
                logits[:, sl] = d
        return logits, None, None, None


def pack_sequences(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], pad_id: int):
    """Right-padded prompt+completion batch for scoring completion tokens.

    -> input_ids (B, L), attention_mask (B, L), targets (B, C), completion_mask (B, C), start (B,)
    where targets[b, t] is completion token t of row b, predicted by the logits at position
    start[b] + t (start = prompt length - 1), and C is the longest completion.
    """
    B = len(prompt_ids)
    L = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True))
    C = max((len(c) for c in completion_ids), default=0)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    targets = torch.full((B, C), pad_id, dtype=torch.long)
    cmask = torch.zeros((B, C), dtype=torch.bool)
    start = torch.zeros(B, dtype=torch.long)
    for b, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        seq = [*p, *c]
        input_ids[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[b, : len(seq)] = 1
        targets[b, : len(c)] = torch.tensor(list(c), dtype=torch.long)
        cmask[b, : len(c)] = True
        start[b] = len(p) - 1
    return input_ids, attn, targets, cmask, start


def completion_logprobs(model, seqs: Seqs, temperature: float = 1.0,
                        with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """(r, C) log-probs of the completion tokens of `seqs` (`rlkit.ops.packing.layout`, padded or packed)
    under `model` (and their entropies), from one forward pass; 0 past each completion's end.

    Only the K completion positions reach the output head: (K, V) logits, never (R, W, V); without grad
    (scoring) the head runs on SCORE_CHUNK positions at a time."""
    root = getattr(model, "_rlkit_fsdp_root", None)
    if root is not None:  # FSDP2: go through the root unit's forward, whose hooks gather and reduce its weights
        return root(seqs, temperature, with_entropy)  # fn = completion_logprobs_local
    return completion_logprobs_local(model, seqs, temperature, with_entropy)


def padded(input_ids: Tensor, attn: Tensor, start: Tensor) -> Seqs:
    """Right-padded rows (`pack_sequences`' layout) as a padded `Seqs` on their device: a batch made for
    padding, scored through `completion_logprobs`."""
    from rlkit.ops.packing import from_padded, layout

    tokens, plens = from_padded(input_ids.cpu(), attn.cpu(), start.cpu())
    return layout(tokens, plens, packed=False).to(input_ids.device)


SCORE_CHUNK = 1024  # positions per output-head call when scoring (no grad): (SCORE_CHUNK, V) logits at a time
# positions per step of the log-softmax over the (1, K, V) logits of a flat layout: its fp32 temporaries are
# (LOGPROB_CHUNK, V), 0.6 GB at a 152k vocabulary; far fewer, larger kernels than 32 positions at a time
LOGPROB_CHUNK = 1024


def hidden_states(model, seqs: Seqs) -> Tensor:
    """The last layer's hidden states of `seqs`, flat: (R * W, H). `model` is a transformers model with a
    base (decoder) model: a causal LM, a sequence classifier, or a peft model of either."""
    hidden = model.base_model(input_ids=seqs.input_ids, attention_mask=seqs.attn, position_ids=seqs.position_ids,
                              use_cache=False).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])


def completion_logprobs_local(model, seqs: Seqs, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    from rlkit.ops.packing import scatter

    h = hidden_states(model, seqs)[seqs.pos]  # (K, H)
    head = model.get_output_embeddings()
    targets = seqs.targets.unsqueeze(0)
    if torch.is_grad_enabled():  # training: autograd keeps the (K, V) logits for backward anyway
        lp, ent = gather_logprobs(head(h).unsqueeze(0), targets, chunk=LOGPROB_CHUNK, temperature=temperature,
                                  with_entropy=with_entropy)
    else:  # forward-only scoring: SCORE_CHUNK positions at a time, never holding (K, V)
        parts = [gather_logprobs(head(h[s : s + SCORE_CHUNK]).unsqueeze(0), targets[:, s : s + SCORE_CHUNK],
                                 chunk=LOGPROB_CHUNK, temperature=temperature, with_entropy=with_entropy)
                 for s in range(0, len(h), SCORE_CHUNK)]
        lp = torch.cat([p[0] for p in parts], 1) if parts else h.new_zeros((1, 0), dtype=torch.float32)
        ent = torch.cat([p[1] for p in parts], 1) if with_entropy and parts else None
    return scatter(lp[0], seqs), (scatter(ent[0], seqs) if ent is not None else None)
