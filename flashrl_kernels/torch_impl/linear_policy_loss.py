"""The policy head in one pass: hidden states and lm_head weight -> clipped policy loss and its gradients.

Shared by the torch, native and Triton backends (they differ only in the two
per-chunk epilogues, `ChunkKernels`); see ops/linear_policy_loss.py for the op
and docs/linear_policy_loss.md for the design. Per chunk of C loss-carrying
rows (rows whose mask is set; masked rows never reach a GEMM):

  1. z = h_c @ W.T, fp32 [C, V] (2CHV), kept;
  2. the forward epilogue reduces z to each row's lse, target logit and
     entropy -> logp, entropy of the chunk's rows;
  3. the policy-loss backend's own forward + backward on the sequences the
     chunk touches give d loss / d logp and d loss / d entropy of its rows
     (exact, with the global divisor passed as the normalizer);
  4. the backward epilogue turns z into dZ in place (or into the operand
     dtype), then grad_hidden rows = dZ @ W and grad_weight += dZ.T @ h_c
     (4CHV).

So 6NHV of matmul, against 8NHV for policy_loss(linear_token_logprobs(...)),
which recomputes the logits in its backward. Step 3 needs every quantity the
row's gradient depends on: for token-level ratios that is the row itself
plus per-sequence values that do not depend on logp (valid counts,
sequence-TIS weights), so chunks cut anywhere and rows of a sequence not yet
computed hold a placeholder (their old logp). For GSPO's sequence ratio the
whole sequence is needed: chunks hold whole sequences, and a sequence longer
than a chunk takes two passes over its rows (8NHV for those rows only). The
reported loss and metrics come from one more policy-loss forward over all
tokens at the end, so they equal the composition's.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from .._backend import implementation
from .._cpu_gemm import widen_cpu_gemm
from .linear_logprobs import _add_mm, _bwd_epilogue_torch, _fwd_epilogue_torch, _mm_f32, _ranges, merge_over_group

_DEFAULT_CHUNK_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}
_CPU_VOCAB_BLOCK_BYTES = 4 << 20  # GEMM temporaries of the bf16 -> fp32 logits copy and widened W blocks
_CPU_GRAD_BLOCK_ROWS = 4096  # vocab rows per gradient block on a CPU: a 7 MB bf16 W block at H = 896
_DIRECT_F32_DEVICES = ("cuda",)  # where fp32 chunk logits come straight from the GEMM (tests add "cpu")


@dataclasses.dataclass(frozen=True)
class ChunkKernels:
    """The per-chunk epilogues of a backend.

    stats(z, bias, tgt, T, m, s, w, zt): a linear_fwd epilogue over the whole [C, V] chunk (entropy on);
    dz(z, bias, tgt, T, lse, ent, g_lp, g_h, out, m): writes dZ into out (which may be z itself), after
    `stats` ran on z (m: the row maxima it produced, for a stats epilogue that shifted z in place).
    """

    stats: Callable
    dz: Callable
    low_precision_tile: bool = False  # the epilogues read a bf16 / fp16 z (the GEMM's own output) and write dZ over it


def _torch_stats(z, bias, tgt, temperature, m, s, w, zt):
    _fwd_epilogue_torch(z, bias, tgt, temperature, True, m, s, w, zt)  # leaves z = (z + b) / T - m_ref


def _torch_dz(z, bias, tgt, temperature, lse, ent, g_lp, g_h, out, m):
    m_ref = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    dz = _bwd_epilogue_torch(z, None, tgt, 1.0, lse - m_ref, ent, g_lp, g_h, torch.float32)
    if temperature != 1.0:
        dz.mul_(1.0 / temperature)
    if dz.data_ptr() != out.data_ptr():
        out.copy_(dz)


TORCH_KERNELS = ChunkKernels(_torch_stats, _torch_dz)


def chunk_rows(total_rows: int, vocab: int, row_bytes: int, device: torch.device) -> int:
    """Rows per chunk: the logits (and a dZ copy, where one is needed) of one chunk fit FLASHRL_POLICY_CHUNK_BYTES.

    FLASHRL_POLICY_CHUNK_ROWS forces the row count (tests).
    """
    env = os.environ.get("FLASHRL_POLICY_CHUNK_ROWS")
    if env:
        return max(1, min(int(env), total_rows))
    budget = int(os.environ.get("FLASHRL_POLICY_CHUNK_BYTES", "0")) or _DEFAULT_CHUNK_BYTES.get(device.type, 512 << 20)
    rows = max(16, budget // max(vocab * row_bytes, 1))
    return max(1, min(rows, total_rows))


def plan_chunks(seq_of_row: list[int], rows_per_chunk: int, whole_sequences: bool) -> list[list[tuple[int, int]]]:
    """Chunks as lists of [a, b) ranges of loss-carrying rows.

    A chunk with one range is processed in one pass. whole_sequences (GSPO): chunks end at sequence
    boundaries; a sequence with more rows than a chunk becomes one item of several ranges, processed in two
    passes (logprobs of all its ranges first, then their gradients).
    """
    m = len(seq_of_row)
    if not whole_sequences:
        return [[(a, b)] for a, b in _ranges(m, rows_per_chunk)]
    items: list[list[tuple[int, int]]] = []
    start = a = 0
    while a < m:
        b = a
        while b < m and seq_of_row[b] == seq_of_row[a]:
            b += 1
        if b - a > rows_per_chunk:  # a long sequence: flush, then its own two-pass item
            if start < a:
                items.append([(start, a)])
            items.append([(x, min(x + rows_per_chunk, b)) for x in range(a, b, rows_per_chunk)])
            start = b
        elif b - start > rows_per_chunk:
            items.append([(start, a)])
            start = a
        a = b
    if start < m:
        items.append([(start, m)])
    return items


def global_divisor(normalizer, divisor, agg, n_valid, n_nonempty, device):
    """The loss's divisor as a 0-d fp32 tensor, as `policy_loss`'s finalize picks it (known before any logp)."""
    if normalizer is not None:
        return normalizer.reshape(()).float()
    if divisor > 0:
        d = float(divisor)
    elif agg == "token-mean":
        d = float(max(n_valid, 1))
    elif agg == "token-sum":
        d = 1.0
    else:
        d = float(max(n_nonempty, 1))
    return torch.tensor(d, dtype=torch.float32, device=device)


def fused_policy_loss(
    kernels, hidden, weight, bias, targets, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp,
    normalizer, positive, scalars, nll_coef, divisor, uniform_len, temperature, need_hidden, need_weight, need_bias,
    fp32_accumulate, vocab_start=0, vocab_total=None, group=None,
):
    """(loss, metrics, logp_mean, grad_hidden, grad_weight, grad_bias, logp [N], entropy [N]) on canonical inputs.

    scalars: policy_loss's config scalars (eps_low ... entropy_coef). old_logp None: on-policy (old = logp).
    With a process group (vocab-parallel): weight / bias are this rank's rows [vocab_start, +V_local) of
    vocab_total; the chunk statistics are merged over the group and grad_hidden is summed over it.
    """
    n, hdim = hidden.shape
    v_local = weight.shape[0]
    vocab_total = v_local if vocab_total is None else vocab_total
    dev, dtype = hidden.device, hidden.dtype
    f32 = torch.float32
    level, agg, entropy_coef = scalars[3], scalars[8], scalars[10]
    need_bias = need_bias and bias is not None
    need_grad = need_hidden or need_weight or need_bias

    # ---- loss-carrying rows and the chunk plan (host side: one sync for the mask and cu_seqlens) ----
    cu_host = cu_seqlens.tolist()
    nseq = len(cu_host) - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq_of_tok = torch.repeat_interleave(torch.arange(nseq, device=dev), lengths, output_size=n)
    rows = torch.arange(n, device=dev) if mask is None else mask.nonzero()[:, 0]
    dense = rows.numel() == n  # every row carries loss: chunks are row slices (views, no gathers)
    seq_rows = seq_of_tok[rows]
    seq_list = seq_rows.tolist()
    m_rows = len(seq_list)
    widen = widen_cpu_gemm(dtype, dev)
    gemm_dtype = f32 if widen else dtype
    # z in the GEMM's dtype where the epilogues read it (no fp32 copy, dZ written over z), else fp32
    z_dtype = gemm_dtype if kernels.low_precision_tile else f32
    dz_separate = z_dtype != gemm_dtype  # fp32 z, bf16 / fp16 dZ for the gradient GEMMs
    esize = torch.empty(0, dtype=gemm_dtype).element_size()
    row_bytes = torch.empty(0, dtype=z_dtype).element_size() + (esize if dz_separate and dev.type != "cpu" else 0)
    c_rows = chunk_rows(max(m_rows, 1), v_local, row_bytes, dev)
    items = plan_chunks(seq_list, c_rows, whole_sequences=level == "sequence")

    d = global_divisor(normalizer, divisor, agg, m_rows, len(set(seq_list)), dev)
    nll_tok = None
    if positive is not None and nll_coef != 0.0:
        pos_rows = positive[seq_rows]
        nll_tok = pos_rows * (-nll_coef / pos_rows.sum().clamp(min=1.0))

    # ---- buffers ----
    old32 = None if old_logp is None else old_logp.float()
    logp_buf = old32.clone() if old32 is not None else torch.zeros(n, dtype=f32, device=dev)
    ent_buf = torch.zeros(n, dtype=f32, device=dev)
    lse_rows = torch.zeros(m_rows, dtype=f32, device=dev)
    c_alloc = min(c_rows, max(m_rows, 1))
    # off the CPU a bf16 / fp16 GEMM writes fp32 logits itself (out_dtype): each chunk's z is the GEMM's own
    # output (the caching allocator reuses it), no buffer and no copy pass
    direct_f32 = dev.type in _DIRECT_F32_DEVICES and z_dtype == f32 and dtype != f32 and not widen
    zbuf = None if direct_f32 else torch.empty((c_alloc, v_local), dtype=z_dtype, device=dev)
    # gradient phase in vocab blocks on a CPU (W block and dZ block stay in cache for both GEMMs)
    gblock = min(v_local, _CPU_GRAD_BLOCK_ROWS) if dev.type == "cpu" else v_local
    gh_blocked = gblock < v_local
    dzbuf = None
    if need_grad and dz_separate:
        dzbuf = torch.empty((c_alloc, gblock), dtype=gemm_dtype, device=dev)
    gh_dtype = f32 if (group is not None or widen) else dtype
    gh = None
    if need_hidden:
        gh = (torch.empty if dense else torch.zeros)((n, hdim), dtype=gh_dtype, device=dev)
    multi = len(items) > 1 or (len(items) == 1 and len(items[0]) > 1)
    gw = torch.empty_like(weight) if need_weight else None
    gw_acc = None
    if need_weight and multi and fp32_accumulate and dtype != f32:
        gw_acc = torch.zeros((v_local, hdim), dtype=f32, device=dev)
    gw_started = [False]
    gb = torch.zeros(v_local, dtype=f32, device=dev) if need_bias else None
    vblock = max(256, _CPU_VOCAB_BLOCK_BYTES // (4 * max(hdim, c_alloc, 1)))
    pol_fwd = implementation("policy_loss_forward", dev)
    pol_bwd = implementation("policy_loss_backward", dev)
    one = torch.ones((), dtype=f32, device=dev)

    def row_slice(a, b):
        return slice(a, b) if dense else rows[a:b]

    def logits(h_c):
        if direct_f32:
            return _mm_f32(h_c, weight.T)
        z = zbuf[: h_c.shape[0]]
        if z.dtype == dtype and not widen:  # one GEMM straight into the chunk buffer
            torch.mm(h_c, weight.T, out=z)
        elif widen or dev.type == "cpu":  # blockwise: small temporaries, fp32 z
            h_g = h_c.float() if widen else h_c
            for v0, v1 in _ranges(v_local, vblock):
                w_b = weight[v0:v1].float() if widen else weight[v0:v1]
                z[:, v0:v1] = h_g @ w_b.T
        else:
            z.copy_(_mm_f32(h_c, weight.T))
        return z

    def stats(z, tgt_c):
        c = z.shape[0]
        m = torch.full((c,), float("-inf"), dtype=f32, device=dev)
        s, w, zt = (torch.zeros(c, dtype=f32, device=dev) for _ in range(3))
        kernels.stats(z, bias, tgt_c, temperature, m, s, w, zt)
        m_local = m  # the maxima a stats epilogue that shifts z in place (torch) used
        if group is not None:
            m, s, w, zt = merge_over_group(m, s, w, zt, group)
        log_s = torch.log(s)
        lse = m + log_s
        return zt - lse, log_s - w / s, lse, m_local

    def forward_rows(a, b):
        rs = row_slice(a, b)
        h_c = hidden[rs]
        tgt_c = targets[rs] - vocab_start
        z = logits(h_c)
        lp, ent, lse, m_loc = stats(z, tgt_c)
        logp_buf[rs] = lp
        ent_buf[rs] = ent
        lse_rows[a:b] = lse
        return h_c, tgt_c, z, m_loc

    def coefficients(a, b):
        """d loss / d logp and d loss / d entropy of rows [a, b) from the sequences they touch."""
        s0, s1 = seq_list[a], seq_list[b - 1] + 1
        t0, t1 = cu_host[s0], cu_host[s1]
        cu_c = cu_seqlens[s0:s1 + 1] - t0
        ul = uniform_len if uniform_len > 0 and (t1 - t0) == (s1 - s0) * uniform_len else 0
        adv = advantages[s0:s1] if advantages.numel() != n else advantages[t0:t1]
        lp = logp_buf[t0:t1]
        old = lp if old32 is None else old32[t0:t1]
        msk = None if mask is None else mask[t0:t1]

        def sl(x):
            return None if x is None else x[t0:t1]

        out = pol_fwd(lp, old, adv, msk, cu_c, sl(rollout_logp), sl(ref_logp), ent_buf[t0:t1], d,
                      *scalars, 0.0, ul, None, 0.0)
        _, _, g_tok, g_ent, seq_coef, scale = out
        g_lp, g_ent_t = pol_bwd(one, g_tok, g_ent, seq_coef, msk, cu_c, scale, ul)
        idx = slice(a - t0, b - t0) if dense else rows[a:b] - t0
        g_lp = g_lp[idx].float()
        if nll_tok is not None:
            g_lp = g_lp + nll_tok[a:b]
        return g_lp, (g_ent_t[idx].float() if entropy_coef != 0.0 else None)

    def gradients(a, b, h_c, tgt_c, z, m_loc, g_lp, g_h):
        """dZ and the two gradient GEMMs, one vocab block at a time: each W block is read from memory once
        and used by both GEMMs while it is in cache (dZ block too)."""
        rs = row_slice(a, b)
        c = z.shape[0]
        first = not gw_started[0]
        gw_started[0] = True
        h_g = h_c.float() if widen else h_c
        lse_c, ent_c = lse_rows[a:b], ent_buf[rs]
        gh_acc = torch.zeros((c, hdim), dtype=f32, device=dev) if need_hidden and gh_blocked else None
        for v0, v1 in _ranges(v_local, gblock):
            z_b = z[:, v0:v1]
            dz = z_b if dzbuf is None else dzbuf[:c, : v1 - v0]
            kernels.dz(z_b, None if bias is None else bias[v0:v1], tgt_c - v0, temperature, lse_c, ent_c, g_lp,
                       g_h, dz, m_loc)
            w_b = weight[v0:v1].float() if widen else weight[v0:v1]
            if gh_acc is not None:
                _add_mm(gh_acc, dz, w_b)
            if need_weight:
                if gw_acc is not None:
                    _add_mm(gw_acc[v0:v1], dz.T, h_g)
                elif widen:  # fp32 GEMM, accumulated in the weight dtype
                    if first:
                        gw[v0:v1] = dz.T @ h_g
                    else:
                        gw[v0:v1] += dz.T @ h_g
                elif first:
                    torch.mm(dz.T, h_g, out=gw[v0:v1])
                else:
                    gw[v0:v1].addmm_(dz.T, h_g)
            if need_bias:
                gb[v0:v1].add_(dz.sum(0, dtype=f32))
        if need_hidden:
            if gh_acc is None:  # one vocab block: one GEMM
                part = _mm_f32(dz, w_b) if gh.dtype == f32 else dz @ w_b
            else:
                part = gh_acc
            gh[rs] = part.to(gh.dtype)

    for item in items:
        if len(item) == 1:
            a, b = item[0]
            h_c, tgt_c, z, m_loc = forward_rows(a, b)
            if need_grad:
                g_lp, g_h = coefficients(a, b)
                gradients(a, b, h_c, tgt_c, z, m_loc, g_lp, g_h)
            continue
        for a, b in item:  # a sequence longer than a chunk (GSPO): logprobs first, then gradients
            forward_rows(a, b)
        if need_grad:
            g_lp_all, g_h_all = coefficients(item[0][0], item[-1][1])
            base = item[0][0]
            for a, b in item:
                h_c, tgt_c, z, m_loc = forward_rows(a, b)
                gradients(a, b, h_c, tgt_c, z, m_loc, g_lp_all[a - base:b - base],
                          None if g_h_all is None else g_h_all[a - base:b - base])

    # ---- outputs ----
    if need_hidden and group is not None:
        torch.distributed.all_reduce(gh, group=group)
    gh_out = (gh if gh.dtype == dtype else gh.to(dtype)) if need_hidden else hidden.new_empty(0)
    if need_weight:
        if gw_acc is not None:
            gw.copy_(gw_acc)
        elif not gw_started[0]:
            gw.zero_()
    gw_out = gw if need_weight else hidden.new_empty(0)
    gb_out = gb.to(bias.dtype) if need_bias else hidden.new_empty(0)
    if mask is not None:
        logp_buf.masked_fill_(~mask, 0.0)
    loss, metrics, *_ = pol_fwd(
        logp_buf, logp_buf if old32 is None else old32, advantages, mask, cu_seqlens, rollout_logp, ref_logp,
        ent_buf, normalizer, *scalars, divisor, uniform_len, positive, nll_coef,
    )
    logp_mean = logp_buf.sum() / max(m_rows, 1)
    return loss, metrics, logp_mean, gh_out, gw_out, gb_out, logp_buf, ent_buf


def forward_with(kernels: ChunkKernels):
    """A backend's `linear_policy_loss_forward`: the shared loop with that backend's chunk epilogues."""
    def linear_policy_loss_forward(*args, **group_args):
        return fused_policy_loss(kernels, *args, **group_args)

    return linear_policy_loss_forward


linear_policy_loss_forward = forward_with(TORCH_KERNELS)
