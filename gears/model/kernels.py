"""The kernels behind GEARSNet: autograd Functions with hand-written backwards (each docstring
derives its gradient), the weighted batch-norm, and the sparse graph product as a custom op.

Every one computes what a plain PyTorch expression computes (gears/model/reference.py writes
GEARS with those expressions); they exist for speed: fewer passes over the [U * G, H]
cell-gene rows, no [U, G, H] temporaries in fp32 under autocast, batch-norm statistics weighted
by the cells a deduplicated row stands for, and fewer autograd nodes at small batches. The
architecture that calls them is gears/model/network.py.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn


class _AllReduceSum(torch.autograd.Function):
    """Differentiable sum over processes: the gradient of a sum is the sum of the gradients."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def on_one_thread(op, *args):
    """op(*args) computed by one CPU thread: the same bits whatever torch's thread count.

    Most CPU kernels split an op into pieces whose results do not depend on how many threads
    compute them (elementwise ops, reductions over a dimension that is kept). The training-mode
    batch-norm kernels do not: they sum each channel in one partial sum per thread, so 1 and 2
    threads round differently (and so does a full sum, `invariant_sum`). Running them on one
    thread keeps the training step's bits independent of the thread count, which is what lets
    a run's threads follow the machine's load (gears/train/runtime.py, `ThreadPolicy`). On
    other devices, and at one thread, op(*args) as it is."""
    if torch.compiler.is_compiling() or args[0].device.type != "cpu":
        return op(*args)  # (compiled kernels are not claimed thread-invariant: train.compile)
    n = torch.get_num_threads()
    if n == 1:
        return op(*args)
    torch.set_num_threads(1)
    try:
        return op(*args)
    finally:
        torch.set_num_threads(n)


def invariant_sum(x: torch.Tensor) -> torch.Tensor:
    """x.sum() with the same bits whatever torch's CPU thread count. Above 32,768 elements
    (ATen's grain size) a full CPU sum is split into one partial sum per thread; a sum over the
    last dimension first (split by rows, each summed whole) and then over the rest is not.
    Below it, x.sum() itself (one thread's sum, as before)."""
    if x.device.type != "cpu" or x.numel() < 32768 or x.dim() < 2:
        return x.sum()
    return x.sum(-1).sum()


class _NativeBatchNormFn(torch.autograd.Function):
    """torch.native_batch_norm in training mode (batch statistics, no running ones) with its
    native backward, both on one thread (`on_one_thread`): the same values as autograd through
    the native op at one thread, at any thread count. -> (y, batch mean, batch 1/sqrt(var+eps))."""

    @staticmethod
    def forward(ctx, x, gamma, beta, eps):
        y, mean, invstd = on_one_thread(
            torch.native_batch_norm, x, gamma, beta, None, None, True, 0.0, eps
        )
        ctx.save_for_backward(x, gamma, mean, invstd)
        ctx.eps = eps
        ctx.mark_non_differentiable(mean, invstd)
        return y, mean, invstd

    @staticmethod
    def backward(ctx, dy, _dmean, _dinvstd):
        x, gamma, mean, invstd = ctx.saved_tensors
        mask = list(ctx.needs_input_grad[:3])
        dx, dgamma, dbeta = on_one_thread(
            torch.ops.aten.native_batch_norm_backward,
            *(dy, x, gamma, None, None, mean, invstd, True, ctx.eps, mask),
        )
        return dx, dgamma, dbeta, None


class _WeightedBatchNormFn(torch.autograd.Function):
    """Batch-norm with per-row weights: forward and an analytic backward in few passes.

    With f_i = w_i / sum(w) each row's fraction of the cells: mu = sum(f x),
    var = sum(f (x - mu)^2), xhat = (x - mu) * r, r = 1 / sqrt(var + eps), y = gamma xhat + beta,
    and dx = r gamma (dy - f (sum(dy) + xhat sum(dy xhat))): the usual batch-norm gradient with
    the stats' terms scaled by each row's fraction (f = 1/N gives the standard formula).
    The fractions are normalised by the caller, so no sum grows with the number of cells.
    """

    @staticmethod
    def forward(ctx, x, w_frac, gamma, beta, eps):
        mean = w_frac @ x
        centred = x - mean
        var = w_frac @ (centred * centred)
        r = torch.rsqrt(var + eps)
        xhat = centred.mul_(r)
        ctx.save_for_backward(xhat, w_frac, r, gamma)
        ctx.mark_non_differentiable(mean, var)  # running statistics only
        return torch.addcmul(beta, xhat, gamma), mean, var

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        xhat, w_frac, r, gamma = ctx.saved_tensors
        dbeta = dy.sum(0)
        dgamma = (dy * xhat).sum(0)
        t = torch.addcmul(dbeta, xhat, dgamma).mul_(w_frac.unsqueeze(1))
        dx = (dy - t).mul_(r * gamma)
        return dx, None, dgamma, dbeta, None


class _BlockWeightedBatchNormFn(torch.autograd.Function):
    """Weighted batch-norm of x [U * k, C] whose rows form U consecutive blocks of k rows, every
    row of block u weighing f_u / k (f [U] sums to 1): GEARSNet's [U*G, H] cell-gene rows,
    where a perturbation's G rows all stand for its cells. A fixed number of kernels whatever
    U (on a GPU each op is a launch: a loop over the blocks made the step's op count grow with
    the distinct perturbations of the batch). Statistics accumulate in fp32 (float64 for
    float64 x) whatever x's dtype:

    forward: the block sums S_u = sum_i x[u, i] (one reduction over the [U, k, C] view), the
    mean = sum_u (f_u / k) S_u, the centred block sums Q_u = sum_i (x[u, i] - mean)^2 and
    var = sum_u (f_u / k) Q_u; then one eval-mode native pass normalises with them.
    backward: the native training-mode backward with these statistics gives the unweighted
    dx_n = r gamma (dy - (sum(dy) + xhat sum(dy xhat)) / N), dgamma and dbeta; the weighted
    gradient adds, per block, s_u r gamma (dbeta + xhat dgamma) with s_u = 1/N - f_u/k and
    xhat = (x - mean) r: x A_u + B_u with A_u = s_u r^2 gamma dgamma and
    B_u = s_u r gamma (dbeta - mean r dgamma), one pass over the [U, k, C] view for every
    block. Equal weights make it exactly zero.

    per_block (default: half-precision x on CPU) computes the same with one native kernel per
    block instead (forward: training-mode statistics of each block combined exactly, Chan et
    al.: mean = sum f_u m_u, var = sum f_u (v_u + (m_u - mean)^2); backward: one eval-mode
    pass per block): on CPU the native kernels read bf16 / fp16 blocks directly, where the
    batched passes above make fp32 [U * k, C] temporaries (far slower on an AVX2 CPU: measured in
    benchmarks/README.md, finding 12).
    """

    @staticmethod
    def forward(ctx, x, f, gamma, beta, eps, blocks, per_block=None):
        k = x.shape[0] // blocks
        if per_block is None:
            per_block = _per_row(x, statistics_dtype(x))
        if torch.compiler.is_compiling():
            # The compiler's native_batch_norm (its decomposition, and the fake kernel traced
            # from it) returns a half-precision CPU input's statistics in that dtype, where the
            # kernel returns fp32: under inductor, statistics rounded to half precision (an
            # fp16 variance above 65,504 became inf); under aot_eager, a dtype mismatch in the
            # traced graph. One fused fp32 reduction instead.
            block_var, block_mean = torch.var_mean(
                x.reshape(blocks, k, -1).to(statistics_dtype(x)), dim=1, correction=0
            )
            f = f.to(block_mean.dtype)
            mean = f @ block_mean
            var = f @ (block_var + (block_mean - mean).square())
        elif per_block:
            parts = [
                on_one_thread(
                    torch.native_batch_norm,
                    *(x[u * k : (u + 1) * k], gamma, beta, None, None, True, 0.0, eps),
                )
                for u in range(blocks)
            ]
            block_mean = torch.stack([p[1] for p in parts])  # [U, C], fp32 (float64 for x64)
            block_var = torch.stack([p[2] for p in parts]).pow(-2).sub_(eps).clamp_(min=0)
            f = f.to(block_mean.dtype)
            mean = f @ block_mean
            var = f @ (block_var + (block_mean - mean).square())
        else:
            stat_dtype = statistics_dtype(x)
            xs = x.view(blocks, k, -1)
            f_row = f.to(stat_dtype) / k  # [U], each row's fraction of the cells
            mean = f_row @ xs.sum(1, dtype=stat_dtype)
            var = f_row @ (xs - mean).square_().sum(1)  # (x - mean: in stat_dtype)
        y = torch.native_batch_norm(x, gamma, beta, mean, var, False, 0.0, eps)[0]
        ctx.save_for_backward(x, f, gamma, mean, var)
        ctx.eps, ctx.blocks, ctx.per_block = eps, blocks, per_block
        ctx.mark_non_differentiable(mean, var)  # running statistics only
        return y, mean, var

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        x, f, gamma, mean, var = ctx.saved_tensors
        eps, blocks = ctx.eps, ctx.blocks
        k = x.shape[0] // blocks
        r = torch.rsqrt(var + eps)
        dx, dgamma, dbeta = on_one_thread(
            torch.ops.aten.native_batch_norm_backward,
            *(dy.contiguous(), x, gamma, None, None, mean, r, True, eps, [True, True, True]),
        )
        # Correction to the per-block weights, an affine function of xhat = (x - mean) r.
        s = torch.rsub(f.to(r.dtype), 1.0 / x.shape[0], alpha=1.0 / k).unsqueeze(1)  # [U, 1]
        r_gamma = r * gamma
        if ctx.per_block:
            slope, offset = s * (r_gamma * dgamma), s * (r_gamma * dbeta)  # [U, C]
            for u in range(blocks):
                rows = slice(u * k, (u + 1) * k)
                dx[rows] += torch.native_batch_norm(
                    x[rows], slope[u], offset[u], mean, var, False, 0.0, eps
                )[0]
        else:
            r_dgamma = r * dgamma
            a = r_gamma * r_dgamma  # [C]
            b = torch.addcmul(dbeta, mean, r_dgamma, value=-1).mul_(r_gamma)  # [C]
            dxs = dx.view(blocks, k, -1)
            dxs.addcmul_(x.view(blocks, k, -1), (s * a).unsqueeze(1)).add_((s * b).unsqueeze(1))
        return dx, None, dgamma, dbeta, None, None, None


def _per_row(x: torch.Tensor, other: torch.dtype) -> bool:
    """Whether the [U, G, H] passes below, whose temporaries are in `other`'s dtype, loop over
    x's leading rows: on CPU when that differs from x's (a half-precision x), so that a row's
    fp32 temporaries ([G, H]) stay in cache (all rows at once stream them through memory:
    measured in benchmarks/README.md, finding 10; blocks of rows were slower than single rows).
    Otherwise one kernel for every row (faster for fp32 on CPU, where the per-row loop slowed
    evaluation, and on other devices)."""
    return x.device.type == "cpu" and x.dtype != other


def _outer_sum_relu(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """relu(a[g] + b[u]) for a [G, C] and b [U, C] -> [U, G, C] in `dtype`, row by row
    (_per_row). The sum is taken in the inputs' dtype (fp32) and rounded once: adding a and
    b rounded to half precision would move the ReLU's mask wherever a ~ -b (~1% of a's
    gradient in bf16)."""
    out = torch.empty((b.shape[0], *a.shape), dtype=dtype, device=a.device)
    if _per_row(out, a.dtype):
        for out_u, b_u in zip(out.unbind(0), b.unbind(0)):
            torch.add(a, b_u, out=out_u).relu_()
    else:
        torch.add(a.unsqueeze(0), b.unsqueeze(1), out=out).relu_()
    return out


def _outer_sum_relu_grads(
    grad: torch.Tensor, out: torch.Tensor, in_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients to a and b of out = _outer_sum_relu(a, b): the ReLU's mask, then a sum over
    rows for a (accumulated and returned in fp32: a's batch-norm gradient subtracts its large
    common part) and over genes for b (the native sum in out's dtype, fp32 accumulation,
    rounded once). -> (d_a [G, C], d_b [U, C]) in in_dtype."""
    if not _per_row(out, in_dtype):
        masked = torch.ops.aten.threshold_backward(grad, out, 0)
        return masked.sum(0, dtype=in_dtype), masked.sum(1).to(in_dtype)
    d_a = torch.zeros(out.shape[1:], dtype=in_dtype, device=out.device)
    d_b = torch.empty((out.shape[0], out.shape[2]), dtype=in_dtype, device=out.device)
    for grad_u, out_u, d_b_u in zip(grad.unbind(0), out.unbind(0), d_b.unbind(0)):
        masked = torch.ops.aten.threshold_backward(grad_u, out_u, 0)
        d_a += masked
        d_b_u.copy_(masked.sum(0))
    return d_a, d_b


class _OuterSumReluFn(torch.autograd.Function):
    """relu(a[g] + b[u]) -> [U, G, C] in `dtype` (_outer_sum_relu, _outer_sum_relu_grads)."""

    @staticmethod
    def forward(ctx, a, b, dtype):
        out = _outer_sum_relu(a, b, dtype)
        ctx.save_for_backward(out)
        ctx.in_dtype = a.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return *_outer_sum_relu_grads(grad, out, ctx.in_dtype), None


class _OuterSumBatchNormReluFn(torch.autograd.Function):
    """relu(gamma * xhat + beta) for the U*G rows x[u, g] = a[g] + b[u] batch-normalised with
    their own statistics, row (u, g) weighing f[u] / G (f [U] sums to 1; None: 1 / U), one
    autograd node with an analytic backward (WeightedBatchNorm1d.outer_sum_relu's training
    path; autograd through its ~25 small [G, C] and [U, C] ops cost more in dispatch than
    their arithmetic). a, b, f, gamma, beta share the statistics dtype.

    With ca = a - mean(a), cb = b - sum_u f_u b_u, r = 1 / sqrt(var(a) + var_f(b) + eps):
    xhat = ahat[g] + bhat[u] (ahat = ca r, bhat = cb r). Backward from dA = sum_u dy[u, g] and
    dB = sum_g dy[u, g] (dy the gradient after the ReLU's mask): dbeta = S1 = sum(dA),
    dgamma = S2 = sum(dA ahat) + sum(dB bhat), and the weighted batch-norm gradient
    r gamma (dy - f_u / G (S1 + xhat S2)) summed over u (for a) and over g (for b), where
    sum_g ahat = sum_u f_u bhat_u = 0 leaves d_a = r gamma (dA - (S1 + ahat S2) / G) and
    d_b = r gamma (dB - f_u (S1 + bhat S2))."""

    @staticmethod
    def forward(ctx, a, b, f, gamma, beta, eps, dtype):
        mean_a = a.mean(0)
        ca = a - mean_a
        var_a = ca.square().mean(0)
        if f is None:
            mean_b = b.mean(0)
            cb = b - mean_b
            var_b = cb.square().mean(0)
        else:
            mean_b = f @ b
            cb = b - mean_b
            var_b = f @ cb.square()
        var = var_a + var_b
        r = torch.rsqrt(var + eps)
        scale = r * gamma
        out = _outer_sum_relu(torch.addcmul(beta, ca, scale), cb * scale, dtype)
        ctx.save_for_backward(out, ca, cb, r, gamma, f)
        ctx.in_dtype = a.dtype
        mean = mean_a + mean_b
        ctx.mark_non_differentiable(mean, var)  # running statistics only
        return out, mean, var

    @staticmethod
    def backward(ctx, grad, _dmean, _dvar):
        out, ca, cb, r, gamma, f = ctx.saved_tensors
        d_a_part, d_b_part = _outer_sum_relu_grads(grad, out, ctx.in_dtype)
        ahat, bhat = ca * r, cb * r
        s1 = d_a_part.sum(0)
        s2 = (d_a_part * ahat).sum(0) + (d_b_part * bhat).sum(0)
        scale = r * gamma
        d_a = (d_a_part - torch.addcmul(s1, ahat, s2).div_(ca.shape[0])).mul_(scale)
        f_u = 1.0 / cb.shape[0] if f is None else f.unsqueeze(1)
        d_b = (d_b_part - torch.addcmul(s1, bhat, s2).mul_(f_u)).mul_(scale)
        return d_a, d_b, None, s2, s1, None, None


def statistics_dtype(x: torch.Tensor) -> torch.dtype:
    """Batch statistics are never computed in half precision: fp16 sums overflow at 65,504 and
    bf16 ones carry ~4e-3 relative error. float64 nets keep float64."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


class CellWeights(NamedTuple):
    """Row weights already divided by their total, with that total: fractions [R] (or [U] with
    blocks=U, one per block of rows) sum to 1 (all 0 when they stand for no cell), and every row
    (every row of a block) stands for fractions * cells cells. cells is a Python number when the
    host knows it (GEARSNet: the batch's cell count), else a 0-dim tensor. A network makes one
    and every batch-norm of the step shares it: none of them sums or divides the weights again,
    and with a Python number the running statistics take the native path's few ops."""

    fractions: torch.Tensor
    cells: torch.Tensor | float


class WeightedBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d whose batch statistics weight each row by a multiplicity.

    A batch of B cells that share U < B perturbations is computed on U distinct rows; weighting
    row u by the number of cells it stands for gives exactly the statistics, gradients and
    running-stat update of the per-cell batch. A scalar weight (every row stands for the same
    number of cells) takes PyTorch's native kernel. `sync=True` all-reduces the weighted sums
    across processes: a SyncBatchNorm that also works with gloo on CPU.

    Weighted and synchronised statistics run in fp32 (float64 for a float64 net) with autocast
    disabled, on weights divided by their total first; the output returns in the input's dtype.
    The training step makes no host synchronisation here (no tensor built from a Python number).
    """

    sync: bool = False

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | float | CellWeights | None = None,
        blocks: int | None = None,
    ) -> torch.Tensor:
        """x [N, C]; weight [N] row multiplicities (0 excludes a row), a scalar, None (= 1), or
        CellWeights (fractions [N], or [U] with blocks=U). blocks=U: the caller guarantees that
        x's rows are U equal consecutive blocks whose rows share one weight (GEARSNet's
        cell-gene rows); the statistics are then reduced per block (_BlockWeightedBatchNormFn).
        """
        if not self.training:
            return super().forward(x)
        distributed = self.sync and dist.is_available() and dist.is_initialized()
        stat_dtype = statistics_dtype(x)
        fractions, n = None, None
        if isinstance(weight, CellWeights):
            # cells stand for rows of weight fractions * cells; a block's k rows each as much.
            fractions = weight.fractions.to(stat_dtype)
            n = weight.cells * (x.shape[0] // fractions.shape[0])
        tensor_weight = fractions is not None or (torch.is_tensor(weight) and weight.dim() == 1)
        # bf16/fp16 x too: the block statistics accumulate in fp32.
        if tensor_weight and not distributed and blocks is not None and blocks > 1:
            if fractions is None:
                block_w = weight.reshape(blocks, -1)[:, 0].to(stat_dtype)  # [U], no host sync
                total = block_w.sum()
                # All-zero weights (no perturbed row): fractions 0, statistics 0, output finite.
                fractions, n = block_w / total.clamp(min=1e-12), total * (x.shape[0] // blocks)
            with torch.autocast(x.device.type, enabled=False):
                y, mean, var = _BlockWeightedBatchNormFn.apply(
                    x, fractions, self.weight, self.bias, self.eps, blocks
                )
            self._update_running(mean, var, n)
            return y
        if not tensor_weight and not distributed and x.shape[0] > 1:
            # The native kernel returns the batch mean and 1/sqrt(var + eps) it normalised with:
            # the running statistics need no second pass over x (torch.var_mean cost several times
            # more: benchmarks/README.md, finding 2).
            if x.device.type == "cpu" and not torch.compiler.is_compiling():
                y, mean, invstd = _NativeBatchNormFn.apply(x, self.weight, self.bias, self.eps)
            else:
                y, mean, invstd = torch.native_batch_norm(
                    x, self.weight, self.bias, None, None, True, 0.0, self.eps
                )
            var = invstd.pow(-2).sub_(self.eps).clamp_(min=0)  # (no autograd: not differentiable)
            # weight: a Python number or a 0-dim tensor (never turned into a number: a sync).
            self._update_running(mean, var, x.shape[0] * (1.0 if weight is None else weight))
            return y
        with torch.autocast(x.device.type, enabled=False):
            xf = x.to(stat_dtype)
            if fractions is not None and fractions.shape[0] == x.shape[0] and not distributed:
                w_frac, total = fractions, n
            else:
                w = self._row_weights(weight, fractions, x.shape[0], stat_dtype, x.device)
                if distributed:
                    return self._sync_forward(xf, w).to(x.dtype)
                total = w.sum()
                # All-zero weights (no perturbed row): fractions 0, statistics 0, output finite.
                w_frac = w / total.clamp(min=1e-12)
            y, mean, var = _WeightedBatchNormFn.apply(xf, w_frac, self.weight, self.bias, self.eps)
            self._update_running(mean, var, total)
        return y.to(x.dtype)

    @staticmethod
    def _row_weights(weight, fractions, rows: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Every row's multiplicity [rows] in dtype, from forward's weight (fractions: its
        CellWeights' fractions in dtype, per row or per block of rows)."""
        if fractions is not None:
            w = fractions * weight.cells  # each row's (each block's) cells
            return w.repeat_interleave(rows // fractions.shape[0]) if len(w) != rows else w
        if torch.is_tensor(weight) and weight.dim() == 1:
            return weight.to(dtype)
        # weight: None, a number or a 0-dim (device) tensor, broadcast without a host read.
        w = torch.ones(rows, dtype=dtype, device=device)
        return w if weight is None else w * weight

    def _sync_forward(self, xf: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Weighted statistics over all processes, then the normalisation of the local rows."""
        mean, var, total = self._weighted_stats(xf, w, distributed=True)
        self._update_running(mean.detach(), var.detach(), total)
        return (xf - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias

    def _momentum(self) -> float:
        """The running statistics' update weight: momentum, or 1 / batches counted (None)."""
        if self.momentum is not None:
            return self.momentum
        return 1.0 / max(float(self.num_batches_tracked), 1.0)  # (a host read, as in PyTorch)

    @staticmethod
    def _weighted_stats(
        xf: torch.Tensor, w: torch.Tensor, distributed: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mean and (biased) variance of the rows of xf [N, C] weighted by w [N], both in the
        statistics dtype, and the total weight -> (mean [C], var [C], total []). distributed:
        over every process's rows (differentiable all-reduce). The total is all-reduced first so
        that every process sums fractions of the global batch (bounded by the data's own
        scale); the mean and the centred second moment take one all-reduce each."""
        total = w.sum()
        if distributed:
            total = total.reshape(1)
            dist.all_reduce(total)
            total = total[0]
        # All-zero weights (no perturbed row): fractions 0, statistics 0, output finite.
        w_frac = w / total.clamp(min=1e-12)
        mean = w_frac @ xf
        if distributed:
            mean = _AllReduceSum.apply(mean)
        centred = xf - mean
        var = w_frac @ (centred * centred)
        if distributed:
            var = _AllReduceSum.apply(var)
        return mean, var, total

    def outer_sum_relu(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        weight: torch.Tensor | float | CellWeights | None = None,
    ) -> torch.Tensor:
        """relu(BN(a[g] + b[u])) for every pair of a's G rows and b's U rows -> [U, G, C], the
        U*G rows (u, g) batch-normalised together, row (u, g) weighing weight[u] (a [U] tensor,
        CellWeights with [U] fractions, a scalar for every row, or None = 1): GEARSNet's gene
        embeddings plus each perturbation's fused embedding. Equal to forward() on the [U*G, C]
        rows with weight[u] repeated G times, without forming them: over a product of rows the
        weighted mean is mean(a) + mean_w(b) and the variance var(a) + var_w(b) (the cross term
        sums to zero), so the statistics cost (G + U) C instead of U G C, and the normalisation
        folds into a [G, C] and a [U, C] term: BN(a[g] + b[u]) = A[g] + B[u]. The only
        [U, G, C] passes are the sum with its ReLU and, backward, the mask and two sums.
        Statistics in fp32 (float64 for float64 inputs) with autocast disabled; the result in
        the autocast dtype when autocast is on, else in the inputs' dtype."""
        device = a.device.type
        out_dtype = (
            torch.get_autocast_dtype(device)
            if torch.is_autocast_enabled(device)
            else torch.promote_types(a.dtype, b.dtype)
        )
        stat_dtype = torch.promote_types(statistics_dtype(a), statistics_dtype(b))
        G, U = a.shape[0], b.shape[0]
        batch_stats = self.training or self.running_mean is None
        distributed = self.sync and dist.is_available() and dist.is_initialized()
        with torch.autocast(device, enabled=False):
            af, bf = a.to(stat_dtype), b.to(stat_dtype)
            # One node with an analytic backward; the general path below serves evaluation,
            # sync-BN over processes, no affine, and the compiler (which fuses it).
            fused = batch_stats and self.affine and not distributed
            if fused and not torch.compiler.is_compiling():
                if isinstance(weight, CellWeights):
                    f, n = weight.fractions.to(stat_dtype), G * weight.cells
                elif torch.is_tensor(weight):
                    w = weight.to(stat_dtype)
                    total = w.sum()
                    # All-zero weights (no perturbed row): fractions 0, output finite.
                    f, n = w / total.clamp(min=1e-12), G * total
                else:
                    f, n = None, U * G * (1.0 if weight is None else weight)
                out, mean, var = _OuterSumBatchNormReluFn.apply(
                    af, bf, f, self.weight, self.bias, self.eps, out_dtype
                )
                if self.training:
                    self._update_running(mean, var, n)
                return out
            if batch_stats:
                # (torch.var_mean over dim 0 costs several times these passes on [G, C])
                mean_a = af.mean(0)
                centred_a = af - mean_a
                var_a = (centred_a * centred_a).mean(0)
                if torch.is_tensor(weight) or isinstance(weight, CellWeights) or distributed:
                    if isinstance(weight, CellWeights):
                        w = weight.fractions * weight.cells
                    elif torch.is_tensor(weight):
                        w = weight
                    else:
                        w = torch.full(
                            (U,), 1.0 if weight is None else float(weight), device=b.device
                        )
                    mean_b, var_b, total = self._weighted_stats(bf, w.to(stat_dtype), distributed)
                    n = G * total
                else:
                    mean_b = bf.mean(0)
                    var_b = (bf - mean_b).square().mean(0)
                    n = U * G * (1.0 if weight is None else weight)
                mean, var = mean_a + mean_b, var_a + var_b
                if self.training:
                    self._update_running(mean.detach(), var.detach(), n)
            else:  # eval: the running statistics, all of the mean on the gene side
                centred_a, mean_b, var = af - self.running_mean, 0.0, self.running_var
            scale = torch.rsqrt(var + self.eps)
            if self.affine:
                scale = scale * self.weight
            a_part = centred_a * scale
            if self.affine:
                a_part = a_part + self.bias
            b_part = (bf - mean_b) * scale
            if torch.compiler.is_compiling():  # the compiler fuses it
                return torch.relu(a_part.unsqueeze(0) + b_part.unsqueeze(1)).to(out_dtype)
            return _OuterSumReluFn.apply(a_part, b_part, out_dtype)

    def _update_running(
        self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor | float
    ) -> None:
        """Running statistics from a batch standing for n cells: running_var takes the unbiased
        var * n / (n - 1). mean and var carry no autograd history (the batch-norm Functions
        mark them non-differentiable; the other callers detach them).
        n is a Python number or a 0-dim device tensor; neither path copies a Python number to
        the device (each such copy is a host-device synchronisation). Few ops: this runs ~10
        times a step, where each op's dispatch costs about what its work does."""
        if not self.track_running_stats:
            return
        dtype = self.running_mean.dtype
        if torch.is_tensor(n):
            # A batch whose rows all weigh 0 (no perturbed cell) is not one: it leaves the
            # statistics and the count alone (GEARS skips the fusion MLP for it).
            counted = n > 0
            self.num_batches_tracked.add_(counted)  # (+= would run __setattr__)
            n = n.to(dtype)
            # counted * m keeps m exact in the statistics' dtype: torch.where(n > 0, m, 0.0)
            # made it a float32 0.1, and float64 running statistics drifted by 1.5e-8 of each
            # update.
            m = counted.to(dtype) * self._momentum()
            unbiased = var.to(dtype) * (n / (n - 1).clamp(min=1))
        else:
            if n <= 0:
                return
            self.num_batches_tracked.add_(1)
            m = self._momentum()
            unbiased = var.to(dtype) * (n / max(n - 1, 1))
        self.running_mean.lerp_(mean.to(dtype), m)
        self.running_var.lerp_(unbiased, m)


@torch.library.custom_op("gears::graph_propagate", mutates_args=())
def graph_propagate(
    crow: torch.Tensor,
    col: torch.Tensor,
    values: torch.Tensor,
    crow_t: torch.Tensor,
    col_t: torch.Tensor,
    values_t: torch.Tensor,
    x: torch.Tensor,
) -> torch.Tensor:
    """A @ x for a fixed sparse A given as CSR (crow [N+1], col [E], values [E]) and its
    transpose (for the gradient). x [N, H] -> [N, H], in fp32 for half-precision inputs (sparse
    kernels have none) and in x's dtype otherwise. A custom op, so that torch.compile treats
    the sparse product as one opaque node instead of breaking the graph around it."""
    return _csr_product(crow, col, values, x)


def _csr_product(
    crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """A @ x for the CSR matrix (crow, col, values), in fp32 for half-precision x."""
    dtype = statistics_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        adj = torch.sparse_csr_tensor(
            crow,
            col,
            values.to(dtype),
            (crow.numel() - 1, x.shape[0]),
            dtype=dtype,
            check_invariants=False,  # checked once, when the graph was built
        )
        return torch.sparse.mm(adj, x.to(dtype))


@graph_propagate.register_fake
def _(crow, col, values, crow_t, col_t, values_t, x):
    return x.new_empty((crow.numel() - 1, x.shape[1]), dtype=statistics_dtype(x))


def _graph_propagate_setup(ctx, inputs, output):
    *_, crow_t, col_t, values_t, x = inputs
    ctx.save_for_backward(crow_t, col_t, values_t)
    ctx.x_dtype = x.dtype


def _graph_propagate_backward(ctx, grad):
    crow_t, col_t, values_t = ctx.saved_tensors
    # d(A x)/dx applied to grad is A^T grad: the same product with the transposed graph.
    dx = graph_propagate(crow_t, col_t, values_t, crow_t, col_t, values_t, grad.contiguous())
    return None, None, None, None, None, None, dx.to(ctx.x_dtype)


graph_propagate.register_autograd(_graph_propagate_backward, setup_context=_graph_propagate_setup)


class _GraphPropagateFn(torch.autograd.Function):
    """graph_propagate for eager mode: the same product and gradient through a plain autograd
    Function, which costs less per call than the torch.library custom op's Python dispatch (two
    calls a step). torch.compile uses the custom op (an opaque node instead of a graph break
    around the sparse tensor)."""

    @staticmethod
    def forward(ctx, crow, col, values, crow_t, col_t, values_t, x):
        ctx.save_for_backward(crow_t, col_t, values_t)
        ctx.x_dtype = x.dtype
        return _csr_product(crow, col, values, x)

    @staticmethod
    def backward(ctx, grad):
        crow_t, col_t, values_t = ctx.saved_tensors
        dx = _csr_product(crow_t, col_t, values_t, grad.contiguous())
        return None, None, None, None, None, None, dx.to(ctx.x_dtype)


class _GeneDecodeFn(torch.autograd.Function):
    """GEARSNet's per-gene decoder w[u, g] = sum_h out[u, g, h] w1[g, h] for out [U, G, H] in any
    float dtype and w1 [G, H] -> [U, G] in w1's dtype: what `(out * w1).sum(-1)` computes (exact
    products and sums in w1's dtype), row by row (_per_row). The backward writes d_out in
    out's dtype directly (products in w1's dtype, rounded once) and accumulates d_w1 a block at
    a time; out is saved as it is (no [U, G, H] copy in w1's dtype is ever held)."""

    @staticmethod
    def forward(ctx, out, w1):
        if _per_row(out, w1.dtype):
            res = torch.empty(out.shape[:2], dtype=w1.dtype, device=out.device)
            for out_u, res_u in zip(out.unbind(0), res.unbind(0)):
                torch.sum(out_u * w1, -1, out=res_u)
        else:
            res = (out * w1).sum(-1)
        ctx.save_for_backward(out, w1)
        return res

    @staticmethod
    def backward(ctx, grad):
        out, w1 = ctx.saved_tensors
        d_out = torch.empty_like(out)
        g = grad.unsqueeze(-1)  # [U, G, 1]
        if not _per_row(out, w1.dtype):
            torch.mul(g, w1, out=d_out)
            return d_out, (g * out).sum(0)
        d_w1 = torch.zeros_like(w1)
        for g_u, out_u, d_out_u in zip(g.unbind(0), out.unbind(0), d_out.unbind(0)):
            torch.mul(g_u, w1, out=d_out_u)  # computed in w1's dtype, stored in out's
            d_w1.addcmul_(out_u, g_u)
        return d_out, d_w1


class _OutputLayerFn(torch.autograd.Function):
    """GEARS's second per-gene layer, delta = w * w2[:, 0] + cross @ w2[:, 1:]^T + b2, for w
    [U, G], cross [U, H], w2 [1, G, H + 1], b2 [1, G] -> [U, G], as one autograd node: the
    expression's ~8 nodes (select and slice backwards each fill a zero [G, H + 1] gradient)
    cost more in dispatch than its arithmetic at a few rows. Inputs share one float dtype."""

    @staticmethod
    def forward(ctx, w, cross, w2, b2):
        w2 = w2[0]
        delta = torch.addmm(b2, cross, w2[:, 1:].t()).addcmul_(w, w2[:, 0])
        ctx.save_for_backward(w, cross, w2)
        return delta

    @staticmethod
    def backward(ctx, grad):
        w, cross, w2 = ctx.saved_tensors
        d_w2 = torch.empty((1, *w2.shape), dtype=w2.dtype, device=w2.device)
        torch.sum(grad * w, 0, out=d_w2[0, :, 0])
        d_w2[0, :, 1:] = grad.t() @ cross
        return grad * w2[:, 0], grad @ w2[:, 1:], d_w2, grad.sum(0, keepdim=True)


def output_layer(
    w: torch.Tensor, cross: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
) -> torch.Tensor:
    """w [U, G], cross [U, H], w2 [1, G, H + 1], b2 [1, G] ->
    delta = w * w2[0, :, 0] + cross @ w2[0, :, 1:]^T + b2, [U, G]."""
    if torch.compiler.is_compiling():  # (the compiler fuses the expression)
        return w * w2[0, :, 0] + cross @ w2[0, :, 1:].t() + b2
    return _OutputLayerFn.apply(w, cross, w2, b2)


def gene_decode(out: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """out [U, G, H], w1 [G, H] -> [U, G] = (out * w1).sum(-1), in w1's dtype."""
    if torch.compiler.is_compiling():  # (the compiler fuses the expression)
        return (out * w1).sum(-1)
    with torch.autocast(out.device.type, enabled=False):
        return _GeneDecodeFn.apply(out, w1)


def gcn_norm(
    edge_index: torch.Tensor, edge_weight: torch.Tensor, num_nodes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyG's gcn_norm(add_self_loops=True), the same ops in the same order (tests/test_network.py
    compares the two bit for bit), without importing PyG, whose import pulls in torch._dynamo and
    delays every command's start. Existing self-loops keep their weight (the last one
    for a node with several), the other nodes get weight 1; then w_ij = d_i^-1/2 w_ij d_j^-1/2
    with d the weighted in-degree. edge_index [2, E] (source, target), edge_weight [E]
    -> (edge_index [2, E'], weight [E'])"""
    source, target = edge_index[0], edge_index[1]
    not_loop = source != target
    loop_weight = edge_weight.new_ones(num_nodes)
    loop_weight[source[~not_loop]] = edge_weight[~not_loop]
    nodes = torch.arange(num_nodes, device=edge_index.device)
    edge_index = torch.cat([edge_index[:, not_loop], torch.stack([nodes, nodes])], dim=1)
    edge_weight = torch.cat([edge_weight[not_loop], loop_weight])
    source, target = edge_index[0], edge_index[1]
    degree = edge_weight.new_zeros(num_nodes).scatter_add_(0, target, edge_weight)
    inv_sqrt = degree.pow_(-0.5)
    inv_sqrt.masked_fill_(inv_sqrt == float("inf"), 0)
    return edge_index, inv_sqrt[source] * edge_weight * inv_sqrt[target]


def gcn_normalised_csr(
    edge_index: torch.Tensor, edge_weight: torch.Tensor, num_nodes: int, transpose: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyG SGConv(K=1)'s propagation matrix as CSR: gcn_norm with self-loops (existing ones
    kept), A[target, source] = D^-1/2 (A + I) D^-1/2; duplicate edges summed as message passing
    sums them. transpose=True gives A^T. -> (crow [N+1], col [E'], values [E'] float32)"""
    ei, w = gcn_norm(edge_index.long(), edge_weight.float(), num_nodes)
    rows, cols = (ei[0], ei[1]) if transpose else (ei[1], ei[0])
    adj = torch.sparse_coo_tensor(
        torch.stack([rows, cols]), w, (num_nodes, num_nodes), check_invariants=True
    )
    with warnings.catch_warnings():  # the CSR layout is labelled "beta"; its mm is stable
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        csr = adj.coalesce().to_sparse_csr()
    # Clones, not views of the CSR tensor: a buffer viewing a sparse base cannot be traced.
    return csr.crow_indices().clone(), csr.col_indices().clone(), csr.values().clone()


def csr_to_padded_rows(
    crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, max_padding: float = 4.0
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A CSR matrix's rows as padded neighbour lists -> (index [N, K], weight [N, K]), K the
    longest row, entries in CSR order, padding index 0 with weight 0; row i of A @ x is then
    (weight[i, :, None] * x[index[i]]).sum(0). None when padding would multiply the storage by
    more than max_padding (a few rows much longer than the rest)."""
    n = crow.numel() - 1
    lengths = crow.diff()
    k = int(lengths.max()) if n > 0 else 0
    if k == 0 or n * k > max_padding * max(col.numel(), n):
        return None
    rows = torch.repeat_interleave(torch.arange(n), lengths)
    slots = torch.arange(col.numel()) - crow[:-1].repeat_interleave(lengths)
    index = torch.zeros(n, k, dtype=torch.long)
    weight = torch.zeros(n, k, dtype=values.dtype)
    index[rows, slots] = col
    weight[rows, slots] = values
    return index, weight


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for x [N, ...] and a long index of any shape -> [*index.shape, ...], whose
    gradient is summed in a fixed order. The backward of x[index] (index_put_ with accumulate)
    adds float32 rows with atomics across threads on CPU once the gradient has 32,768 elements,
    so repeated indices (a perturbation's GO neighbours shared across a batch, a distinct row
    broadcast to its cells) made training differ from run to run at 2+ threads; index_select's
    backward (index_add_) sums each row's contributions in index order. Same forward values."""
    flat = x.index_select(0, index.reshape(-1))
    return flat.reshape(*index.shape, *x.shape[1:])


def propagate(x: torch.Tensor, graph: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A @ x for graph = (crow, col, values, crow_t, col_t, values_t), GEARSNet's fixed
    propagation matrix and its transpose: the autograd Function in eager mode, the custom op
    under torch.compile (_GraphPropagateFn); graph = (dense [N, N],): a dense product (in fp32
    for half-precision x, as the sparse one)."""
    if len(graph) == 1:
        with torch.autocast(x.device.type, enabled=False):
            return torch.mm(graph[0].to(statistics_dtype(x)), x.to(statistics_dtype(x)))
    if torch.compiler.is_compiling():
        return graph_propagate(*graph, x)
    return _GraphPropagateFn.apply(*graph, x)
