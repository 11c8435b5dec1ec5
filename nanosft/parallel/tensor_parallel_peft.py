"""QLoRA, DoRA and LoRA dropout under tensor parallel: the pieces torch's parallel styles miss.

parallelize.py lays each LoRA layer's float base and its adapters out with torch's
ColwiseParallel / RowwiseParallel (adapter_tp_plan). This module does, in place, what those styles
cannot, so that every rank computes its piece of what one process computes:
- a 4-bit (NF4) base keeps only its piece of the packed codes and of the per-block absmax: a
  column-parallel layer its output rows, a row-parallel one its input columns, always along whole
  quantization blocks, so its dequantized piece is exactly that slice of the whole weight's.
  Each rank multiplies by its piece; a column-parallel layer sums its input's gradient over the tp
  ranks in backward, a row-parallel one sums its output in forward.
- DoRA's magnitude follows the output dim (column-parallel: split; row-parallel: whole), and the
  weight norm ||W + s B A|| of each output row is taken over the whole row (row-parallel: the sums
  of squares of the pieces are summed over tp).
- lora_dropout of a row-parallel layer, whose input arrives split along its last dim, draws the
  mask of the whole input and keeps its columns: the tp ranks share the generator's state, so each
  uses its slice of the mask one process draws. A column-parallel layer's input is whole on every
  tp rank, so nn.Dropout already draws one process's mask there.
Beyond bitsandbytes + transformers: bitsandbytes' Linear4bit has no tensor-parallel layout,
transformers' tp_plan leaves 4-bit layers whole, and peft's tensor-parallel LoRA layer refuses
DoRA. Built on distributed.py, nf4.py and lora.py (read, never changed).
"""

import fnmatch

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanosft.distributed import is_dtensor
from nanosft.lora import dora_weight_norm
from nanosft.nf4 import Linear4bit


def _is_lora_linear(module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def planned_layers(model, plan):
    """(name, module, style) of every module of `model.model` a plan pattern matches."""
    return [(name, m, style) for pattern, style in plan.items()
            for name, m in model.model.named_modules() if fnmatch.fnmatchcase(name, pattern)]


# ----------------------------------------------------------------------------- collectives
class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the tp ranks (a column-parallel layer's
    whole input: each rank's output rows give part of its gradient). Megatron's copy to the
    tensor-parallel region."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverTP(torch.autograd.Function):
    """Forward sums the pieces' partial outputs over the tp ranks (a row-parallel layer); the
    summed output's gradient is each piece's. Megatron's reduce from the tensor-parallel region."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _local(tensor):
    return tensor.to_local() if is_dtensor(tensor) else tensor


# ----------------------------------------------------------------------------- 4-bit bases
def check_4bit_blocks(model, plan, tp_size: int) -> None:
    """Refuse, naming the layer and the numbers, a 4-bit layer whose tp pieces would cut a
    quantization block (blocks run over the flattened (out, in) weight), or a row-parallel 4-bit
    layer with a bias (its bias would be added once per rank)."""
    for name, m, style in planned_layers(model, plan):
        lin = m.base_layer if _is_lora_linear(m) else m
        if not isinstance(lin, Linear4bit):
            continue
        out_f, in_f, block = lin.out_features, lin.in_features, lin.blocksize
        fix = (f"keep {name} in float (skip_modules / llm_int8_skip_modules), pick a tp_size "
               "that gives whole blocks, or shard with dp_shard_size (FSDP) alone")
        if style == "colwise" and (out_f // tp_size * in_f) % block:
            raise ValueError(
                f"{name}: tensor parallel gives each of tp_size={tp_size} ranks {out_f // tp_size}"
                f" of its {out_f} output rows x in_features={in_f} = "
                f"{out_f // tp_size * in_f} 4-bit values, not a multiple of blocksize={block}: "
                f"a quantization block would be cut; {fix}")
        if style == "rowwise" and (in_f % block or in_f // tp_size % block):
            raise ValueError(
                f"{name}: tensor parallel gives each of tp_size={tp_size} ranks "
                f"in_features/tp_size = {in_f}/{tp_size} = {in_f // tp_size} input columns of "
                f"each row; with blocksize={block} every row piece must be whole blocks "
                f"(in_features and in_features/tp_size multiples of {block}); {fix}")
        if style == "rowwise" and lin.bias is not None:
            raise ValueError(f"{name}: a row-parallel 4-bit layer with a bias is not implemented "
                             f"under tensor parallel; {fix}")


def _full_absmax(quant_state):
    # the fp32 absmax bitsandbytes' dequantize_4bit computes from a double-quantized one
    if not quant_state.nested:
        return quant_state.absmax
    from bitsandbytes.functional import dequantize_blockwise

    absmax = dequantize_blockwise(quant_state.absmax, quant_state.state2)
    absmax += quant_state.offset
    return absmax.float()


def split_linear4bit(lin, style: str, tp_rank: int, tp_size: int) -> None:
    """Keep this rank's piece of a Linear4bit, in place: column-parallel, output rows
    [rank * out/tp, (rank + 1) * out/tp); row-parallel, input columns likewise. Packed codes and
    absmax are sliced (check_4bit_blocks made every piece whole blocks), so the piece dequantizes
    to exactly the slice of the whole weight.
    Differs: the piece keeps its absmax in fp32 (double quantization undone when cutting)."""
    from bitsandbytes.functional import QuantState

    qs, block = lin.quant_state, lin.blocksize
    out_f, in_f = lin.out_features, lin.in_features
    absmax = _full_absmax(qs)
    if style == "colwise":
        rows = out_f // tp_size
        lo, hi = tp_rank * rows * in_f, (tp_rank + 1) * rows * in_f  # flattened values
        packed = lin.weight.data.reshape(-1)[lo // 2:hi // 2]
        absmax = absmax[lo // block:hi // block]
        shape = (rows, in_f)
        if lin.bias is not None:
            lin.bias = nn.Parameter(lin.bias.data[tp_rank * rows:(tp_rank + 1) * rows].clone(),
                                    requires_grad=lin.bias.requires_grad)
    else:
        cols = in_f // tp_size
        lo, hi = tp_rank * cols, (tp_rank + 1) * cols  # columns of every row
        packed = lin.weight.data.reshape(out_f, in_f // 2)[:, lo // 2:hi // 2]
        absmax = absmax.reshape(out_f, in_f // block)[:, lo // block:hi // block]
        shape = (out_f, cols)
    lin.weight = nn.Parameter(packed.reshape(-1, 1).clone(), requires_grad=False)
    lin.quant_state = QuantState(absmax.reshape(-1).clone(), shape=torch.Size(shape), code=qs.code,
                                 blocksize=block, quant_type=qs.quant_type, dtype=qs.dtype)
    lin.out_features, lin.in_features = shape


def _hook_4bit_collectives(lin, style, group) -> None:
    if style == "colwise":  # whole input: its gradient is summed over the ranks' output rows
        lin.register_forward_pre_hook(lambda m, args: (_SumGradOverTP.apply(args[0], group),
                                                       *args[1:]))
    else:  # input columns: the partial products are summed
        lin.register_forward_hook(lambda m, args, out: _SumOverTP.apply(out, group))


# ----------------------------------------------------------------------------- DoRA
class TensorParallelDoraMagnitude(nn.Module):
    """DoRA's magnitude m of a tensor-parallel LoRA layer (`.weight`: column-parallel, a DTensor
    split along the output like the base's rows; row-parallel, whole); called as
    lora.DoraMagnitude is, returning this rank's piece of the DoRA term.
    Mirrors: lora.DoraMagnitude (peft DoraLinearLayer.forward) on the rank's piece
    Differs: row-parallel norms sum the pieces' squares over tp, then take the root."""

    def __init__(self, weight, style, tp_mesh):
        super().__init__()
        self.style, self.group = style, tp_mesh.get_group()
        if style == "colwise":
            from torch.distributed.tensor import DTensor, Shard

            rank, rows = tp_mesh.get_local_rank(), weight.shape[0] // tp_mesh.size()
            piece = weight.data[rank * rows:(rank + 1) * rows].clone()
            weight = nn.Parameter(DTensor.from_local(piece, tp_mesh, [Shard(0)], run_check=False),
                                  requires_grad=weight.requires_grad)
        self.weight = weight

    def _weight_norm(self, weight, lora_weight, scaling):
        if self.style == "colwise":  # whole rows on this rank
            return dora_weight_norm(weight, lora_weight, scaling)
        squares = (weight + scaling * lora_weight).pow(2).sum(dim=1)
        dist.all_reduce(squares, group=self.group)
        return squares.sqrt().to(weight.dtype)

    def forward(self, x, *, lora_A, lora_B, scaling, base_layer, base_result=None):
        """This rank's piece of m / ||W + s B A|| * (W x + s B A x) - (W x + bias)."""
        A, B = _local(lora_A.weight), _local(lora_B.weight)  # (r, in) / (out, r) pieces
        bias_B = None if lora_B.bias is None else _local(lora_B.bias)
        eye = torch.eye(A.shape[1], device=A.device, dtype=A.dtype)
        lora_weight = F.linear(F.linear(eye, A), B, bias_B).T.to(x.dtype)  # (out, in) piece
        if isinstance(base_layer, Linear4bit):
            weight = base_layer.dequantize().to(x.dtype)  # this rank's rows or columns
        else:
            weight = _local(base_layer.weight).to(x.dtype)
        # DoRA 4.3: the norm is a constant for the gradient
        weight_norm = self._weight_norm(weight, lora_weight.detach(), scaling).detach()
        mag_norm_scale = (_local(self.weight) / weight_norm).view(1, -1)
        lora_result = lora_B(lora_A(x))
        if base_result is not None:
            if base_layer.bias is not None:
                base_result = base_result - _local(base_layer.bias)
        elif self.style == "colwise":
            base_result = F.linear(_SumGradOverTP.apply(x, self.group), weight)
        else:
            base_result = _SumOverTP.apply(F.linear(x, weight), self.group)
        return (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling


# ----------------------------------------------------------------------------- dropout
class RowParallelDropout(nn.Module):
    """lora_dropout of a row-parallel layer, whose input holds columns [rank * w, (rank + 1) * w)
    of the whole: draws the whole input's mask (the tp ranks share the generator's state) and keeps
    those columns, so the mask is the slice of one process's.
    Mirrors: torch.nn.Dropout (on CPU: x * (bernoulli(1 - p) / (1 - p)))"""

    def __init__(self, p, tp_rank, tp_size):
        super().__init__()
        self.p, self.tp_rank, self.tp_size = p, tp_rank, tp_size

    def forward(self, x):
        if not self.training:
            return x
        width = x.shape[-1]
        noise = x.new_empty(*x.shape[:-1], width * self.tp_size).bernoulli_(1 - self.p)
        noise = noise[..., self.tp_rank * width:(self.tp_rank + 1) * width] / (1 - self.p)
        return x * noise

    def extra_repr(self):
        return f"p={self.p}, tp_rank={self.tp_rank}, tp_size={self.tp_size}"


# ----------------------------------------------------------------------------- the layers
def parallelize_peft_layers(model, plan, tp_mesh) -> None:
    """After the float layers' plan: split 4-bit bases (bare or under LoRA) and hook their
    collectives, swap DoRA magnitudes and row-parallel dropout for their tensor-parallel forms."""
    rank, size, group = tp_mesh.get_local_rank(), tp_mesh.size(), tp_mesh.get_group()
    for _, m, style in planned_layers(model, plan):
        lin = m.base_layer if _is_lora_linear(m) else m
        if isinstance(lin, Linear4bit):
            split_linear4bit(lin, style, rank, size)
            _hook_4bit_collectives(lin, style, group)
        if not _is_lora_linear(m):
            continue
        for name, magnitude in m.lora_magnitude_vector.items():
            m.lora_magnitude_vector[name] = TensorParallelDoraMagnitude(magnitude.weight, style,
                                                                        tp_mesh)
        for name, dropout in m.lora_dropout.items():
            if style == "rowwise" and isinstance(dropout, nn.Dropout):
                m.lora_dropout[name] = RowParallelDropout(dropout.p, rank, size)
