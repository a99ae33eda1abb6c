"""Make an INT4 checkpoint from a 16/32-bit one: ``minipaged quantize MODEL --method
{rtn,gptq,awq,awq-gptq} --bits 4 --group-size 128 OUT``, written in Hugging Face's format
(`formats`), so that minipaged, vLLM or transformers load it as any GPTQ or AWQ model.

Four ways to pick each group's integers, all with the same grid
(``W ~ (q - z) * s``, ``q`` in ``0 .. 15``):

- **RTN** (round to nearest): each weight rounded on its group's grid, nothing else.
  Written as a GPTQ checkpoint with ``desc_act`` false (the format does not say how
  the integers were chosen);
- **GPTQ** (Frantar et al. 2022, Algorithm 1): columns quantized one at a time, and
  each one's rounding error spread over the columns not yet quantized, weighted by the
  inverse Hessian ``H = 2 X^T X`` of the layer's inputs ``X`` on calibration text, so
  that the *output* ``X W^T`` moves least; in blocks of 128 columns with lazy updates
  (§"Lazy batch-updates"), via a Cholesky factor of ``H^-1`` (§"Cholesky
  reformulation"), with 1% dampening; ``desc_act`` (act-order) takes the columns in
  order of decreasing ``H``'s diagonal and records each one's group in ``g_idx``;
- **AWQ** (Lin et al. 2023, §3): a per-input-channel scale ``s``, searched on a grid
  of 20 per group of projections sharing an input, that minimises the output error of
  ``Q(W * s) / s``; ``s = mean|x|^a / mean|w|^(1-a)`` (AutoAWQ's ``duo_scaling``, its
  default; ``mean|x|^a`` alone without it); ``1 / s`` is folded into the op before
  (RMSNorm's weight, ``up_proj``'s rows for ``down_proj``, ``v_proj``'s for
  ``o_proj`` where there is no GQA), so the model computes the same function, and the
  salient channels (large activations) lose less to rounding.  Then AutoAWQ's
  clipping search (``apply_clip``, `awq_clip`) bounds each group of every projection
  but q and k;
- **AWQ then GPTQ** (``awq-gptq``): AWQ's scales folded in as above, then GPTQ rounds
  the scaled weights (no clipping), llm-compressor's recipe of an ``AWQModifier``
  followed by a ``GPTQModifier`` (AWQ's paper, §5: the two are orthogonal).  The
  scales live in the norms' and projections' weights, so the result is a plain GPTQ
  checkpoint, or AWQ one (below).

Each method's integers are written in GPTQ's format (``checkpoint_format="gptq"``, the
default but for awq) or AWQ's (``"awq"``, the default for awq): the same grid, packed
two ways (`formats`).  GPTQ's stores zero points minus one, so its grids keep them at 1
or more (`min_zero_point`), and has act-order's ``g_idx``; AWQ's stores zero points of
0 and has no ``g_idx``, so its groups stay in column order (no ``desc_act``).

Two standard GPTQ options: ``mse`` (GPTQ's reference ``Quantizer(mse=True)``,
GPTQModel's ``mse``) searches each group's range for the least rounding error
(`fit_grid`; for RTN too), and ``true_sequential`` (AutoGPTQ's) quantizes q/k/v, then
o, then gate/up, then down, each group calibrated on inputs that went through the
groups already quantized (`quantize_layer`).

Calibration runs the Hugging Face model layer by layer, each layer on the previous
layer's quantized outputs, as both papers do.  The calibration text (`calibration_text`)
needs no download: some standard-library modules' docstrings and the Python language
reference that ``help()`` prints, about 124,000 SmolLM2 tokens, none of it in the text
``bench quant`` measures perplexity on.  By default 64 windows of 256 tokens at seeded
random offsets (16,384 tokens, as GPTQ's scripts draw random C4 windows; theirs take
128 x 2048, AutoAWQ's 128 x 512, which a shared 2-core machine cannot afford for
SmolLM2's 30 layers): more than ten tokens per column of SmolLM2's widest input (1,536),
and 1% dampening keeps the Hessian's inverse stable.

It runs torch on one thread by default: GPTQ's inner loop is thousands of small column
updates per layer, too small for torch's thread pool to help, and on a machine whose
other cores are busy its threads wait for each other (SmolLM2's first layer took 15 s
on two threads of a loaded 2-core machine and 2.2 s on one).
"""

from __future__ import annotations

import importlib
import inspect
import json
import pydoc_data.topics
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from minipaged.models.quantization import formats
from minipaged.ops.quant_linear import IntWeight

__all__ = [
    "FORMATS",
    "METHODS",
    "awq_clip",
    "calibration_samples",
    "calibration_text",
    "docstrings",
    "fit_grid",
    "gptq_quantize",
    "quantize_checkpoint",
    "rtn_quantize",
]

METHODS = ("rtn", "gptq", "awq", "awq-gptq")
FORMATS = ("gptq", "awq")  # the checkpoint formats it writes (`formats`)
GPTQ_METHODS = ("gptq", "awq-gptq")  # the ones with a Hessian
CALIBRATION_MODULES = ("argparse", "logging", "unittest", "subprocess", "json")
AWQ_GRID = 20
AWQ_TOKENS = 512  # the searches' sample of each group's inputs
AWQ_MAX_SHRINK = 0.5  # the clipping search's smallest bound: half the largest weight
AWQ_UNCLIPPED = ("self_attn.q_proj", "self_attn.k_proj")
# GPTQ's reference Quantizer's defaults for its ``mse`` search (grid, maxshrink, norm).
MSE_GRID, MSE_MAX_SHRINK, MSE_NORM = 100, 0.8, 2.4
# AutoGPTQ's ``true_sequential`` order for Llama: each group quantized on inputs that
# went through the groups quantized before it.
TRUE_SEQUENTIAL = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def docstrings(modules, imported: bool = True) -> str:
    """The docstrings of ``modules``, of their public classes and functions and, if
    ``imported``, of the modules they import."""
    parts = []
    for name in modules:
        module = importlib.import_module(name)
        for obj in (module, *(getattr(module, n) for n in sorted(dir(module)))):
            own = obj is module or _public(obj, name)
            doc = inspect.getdoc(obj) if own or (imported and inspect.ismodule(obj)) else None
            if doc and doc not in parts:
                parts.append(doc)
    return "\n\n".join(parts)


def calibration_text() -> str:
    """The calibration corpus: the docstrings of `CALIBRATION_MODULES` (not of what they
    import: ``io``'s and ``os``'s are in the bench's perplexity text) and the Python
    language reference's topics that ``help()`` prints (``pydoc_data``, shipped with
    Python): English prose and code, about 124,000 SmolLM2 tokens."""
    topics = pydoc_data.topics.topics
    own = docstrings(CALIBRATION_MODULES, imported=False)
    return own + "\n\n" + "\n\n".join(topics[k] for k in sorted(topics))


def calibration_samples(tokenizer, num_samples: int, seq_len: int, seed: int = 0) -> list:
    """``num_samples`` windows of ``seq_len`` tokens at seeded random offsets in
    `calibration_text`, as GPTQ's and AWQ's scripts draw theirs from C4 or the Pile."""
    ids = torch.tensor(tokenizer(calibration_text())["input_ids"])
    if len(ids) < seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the calibration text's {len(ids)} tokens")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq_len + 1, (num_samples,), generator=g)
    return [ids[i : i + seq_len] for i in starts.tolist()]


def _public(obj, module: str) -> bool:
    return (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == module


def fit_grid(
    w: torch.Tensor, bits: int, sym: bool, mse: bool = False, min_zero: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's scale and integer zero point for the values ``w [N, g]``: symmetric
    (zero at the middle, ``2**(bits-1)``) or spanning ``[min(w, 0), max(w, 0)]``, with a
    zero point of at least ``min_zero`` (`_grid`).

    With ``mse``, GPTQ's reference ``Quantizer(mse=True)`` (GPTQModel's ``mse``): the
    range shrunk to ``1 - i / MSE_GRID`` of itself, ``i < MSE_MAX_SHRINK * MSE_GRID``,
    and each row keeps the shrink whose rounding error ``sum |w - Q(w)|^MSE_NORM`` is
    least (the full range is the first candidate, so it is never worse)."""
    lo, hi = w.min(1).values.clamp(max=0), w.max(1).values.clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    if not mse:
        return _grid(lo, hi, bits, sym, min_zero)
    best = torch.full_like(lo, float("inf"))
    scale, zero = _grid(lo, hi, bits, sym, min_zero)
    for i in range(int(MSE_MAX_SHRINK * MSE_GRID)):
        shrink = 1 - i / MSE_GRID
        s, z = _grid(shrink * lo, shrink * hi, bits, sym, min_zero)
        q = _round(w, s, z, bits)
        error = ((q - z[:, None]) * s[:, None] - w).abs().pow(MSE_NORM).sum(1)
        better = error < best
        best = torch.where(better, error, best)
        scale, zero = torch.where(better, s, scale), torch.where(better, z, zero)
    return scale, zero


def default_format(method: str) -> str:
    """The checkpoint format ``method`` writes unless told: AWQ's for awq, GPTQ's for
    the others."""
    return "awq" if method == "awq" else "gptq"


def min_zero_point(checkpoint_format: str) -> int:
    """The least zero point ``checkpoint_format`` can store: 1 for GPTQ's (it stores
    zero points minus one: `formats.check_gptq_zeros`), 0 for AWQ's."""
    return 0 if checkpoint_format == "awq" else 1


def _grid(lo, hi, bits, sym, min_zero=0):
    """The scale and zero point whose grid spans ``[lo, hi]`` (``lo = -hi`` if ``sym``).
    A zero point below ``min_zero`` (GPTQ's format stores zero points minus one, so it
    needs 1: `formats.check_gptq_zeros`) becomes ``min_zero``, its grid's top still
    reaching ``hi``: one level of 16 spent below 0 on a row that barely goes there."""
    maxq = 2**bits - 1
    scale = ((hi - lo) / maxq).clamp(min=1e-10)
    if sym:
        return scale, torch.full_like(scale, 2 ** (bits - 1))
    zero = torch.round(-lo / scale).clamp(0, maxq)
    low = zero < min_zero
    scale = torch.where(low, (hi / (maxq - min_zero)).clamp(min=1e-10), scale)
    return scale, torch.where(low, float(min_zero), zero)


def _round(w, scale, zero, bits):
    return torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, 2**bits - 1)


def rtn_quantize(
    weight: torch.Tensor, bits: int, group_size: int, sym: bool, mse: bool = False, min_zero=0
) -> IntWeight:
    """Round to nearest, group by group (each group's grid by `fit_grid`)."""
    n, k = weight.shape
    size = k if group_size == -1 else group_size
    q, scales, zeros = torch.empty(n, k), [], []
    for start in range(0, k, size):
        w = weight[:, start : start + size].float()
        scale, zero = fit_grid(w, bits, sym, mse, min_zero)
        q[:, start : start + size] = _round(w, scale, zero, bits)
        scales.append(scale), zeros.append(zero)
    return _int_weight(q, scales, zeros, torch.arange(k) // size, bits)


def _int_weight(q, scales, zeros, g_idx, bits) -> IntWeight:
    return IntWeight(
        q.to(torch.uint8),
        torch.stack(scales, 1),
        torch.stack(zeros, 1).to(torch.int16),
        g_idx,
        bits,
    )


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    act_order: bool = False,
    damp: float = 0.01,
    block: int = 128,
    mse: bool = False,
    min_zero: int = 0,
) -> IntWeight:
    """GPTQ (module docstring) of ``weight [N, K]`` given ``hessian [K, K]``."""
    w, h = weight.float().clone(), hessian.float().clone()
    n, k = w.shape
    dead = torch.diag(h) == 0  # inputs always zero: any value will do
    h[dead, dead], w[:, dead] = 1, 0
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diag(h).mean() * torch.eye(k)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    size = k if group_size == -1 else group_size
    q, scales, zeros = torch.empty(n, k), [], []
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1, hinv1 = w[:, i1:i2].clone(), torch.zeros(n, i2 - i1), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            if (i1 + i) % size == 0:  # a group starts: its grid from the updated weights
                scale, zero = fit_grid(
                    torch.cat([w1[:, i:], w[:, i2:]], 1)[:, :size], bits, sym, mse, min_zero
                )
                scales.append(scale), zeros.append(zero)
            col = w1[:, i]
            q[:, i1 + i] = _round(col[:, None], scale, zero, bits)[:, 0]
            err = (col - (q[:, i1 + i] - zero) * scale) / hinv1[i, i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    inverse = torch.argsort(perm)
    return _int_weight(q[:, inverse], scales, zeros, (torch.arange(k) // size)[inverse], bits)


# -- running the Hugging Face model layer by layer ---------------------------------------
class _Caught(Exception):
    pass


def _layer_inputs(model, samples: list[torch.Tensor]) -> list[tuple[torch.Tensor, dict]]:
    """Each sample's input to the first decoder layer, with the keyword arguments the
    model passes its layers (positions' cos and sin, the causal mask)."""
    caught = []

    def catch(module, args, kwargs):
        caught.append((args[0] if args else kwargs.pop("hidden_states"), kwargs))
        raise _Caught

    hook = model.model.layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for ids in samples:
            try:
                model(ids[None], use_cache=False)
            except _Caught:
                pass
    finally:
        hook.remove()
    return caught


def _run_layer(layer, inputs):
    outs = []
    for hidden, kwargs in inputs:
        out = layer(hidden, **kwargs)
        outs.append((out[0] if isinstance(out, tuple) else out, kwargs))
    return outs


def _projections(layer) -> dict[str, nn.Linear]:
    """The decoder layer's projections by HF name, in an order where each group of
    projections sharing an input is together."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    out = {f"self_attn.{n}": getattr(layer.self_attn, n) for n in names}
    names = ("gate_proj", "up_proj", "down_proj")
    out.update({f"mlp.{n}": getattr(layer.mlp, n) for n in names})
    return out


def _collect(layer, inputs) -> dict[str, torch.Tensor]:
    """Each projection's calibration inputs ``[tokens, K]`` (float32)."""
    seen: dict[str, list] = {}
    hooks = [
        linear.register_forward_hook(
            lambda m, args, out, name=name: seen.setdefault(name, []).append(
                args[0].reshape(-1, args[0].shape[-1]).float()
            )
        )
        for name, linear in _projections(layer).items()
    ]
    try:
        _run_layer(layer, inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: torch.cat(xs) for name, xs in seen.items()}


def _awq_scale(
    layer, inputs: dict[str, torch.Tensor], bits, group_size, duo_scaling, sym=False
) -> None:
    """AWQ's search (module docstring) for each group of projections sharing an input,
    the scales folded into the op before, and the group's ``inputs`` divided by them
    (what the projections now see); in place."""
    groups = [
        (layer.input_layernorm, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        (layer.post_attention_layernorm, ("mlp.gate_proj", "mlp.up_proj")),
        (layer.mlp.up_proj, ("mlp.down_proj",)),
    ]
    attn = layer.self_attn
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:  # no GQA: v's rows feed o
        groups.append((attn.v_proj, ("self_attn.o_proj",)))
    projections = _projections(layer)
    for before, names in groups:
        linears = [projections[name] for name in names]
        x = _awq_sample(inputs[names[0]])
        w = torch.cat([linear.weight.float() for linear in linears])
        scale = _awq_best_scale(x, w, bits, group_size, duo_scaling, sym)
        dtype = before.weight.dtype
        if isinstance(before, nn.Linear):  # its output rows are the next one's inputs
            before.weight.copy_((before.weight.float() / scale[:, None]).to(dtype))
        else:
            before.weight.copy_((before.weight.float() / scale).to(dtype))
        for name, linear in zip(names, linears):
            linear.weight.copy_((linear.weight.float() * scale).to(linear.weight.dtype))
            inputs[name] = inputs[name] / scale


def _awq_sample(x: torch.Tensor) -> torch.Tensor:
    """`AWQ_TOKENS` rows of ``x``, evenly spaced: the searches' sample."""
    return x[torch.linspace(0, len(x) - 1, min(len(x), AWQ_TOKENS)).long()]


def _awq_best_scale(x, w, bits, group_size, duo_scaling, sym=False) -> torch.Tensor:
    """The per-input-channel scale ``s`` on AWQ's grid that minimises the error of
    ``x Q(w s)^T / s`` against ``x w^T`` (``Q`` with zero points, AWQ's, unless
    ``sym``): ``s = mean|x|^a``, or with ``duo_scaling`` (AutoAWQ's default)
    ``mean|x|^a / mean|w|^(1-a)``, ``|w|`` relative to its group's largest."""
    reference = x @ w.T
    x_mean = x.abs().mean(0)
    size = w.shape[1] if group_size == -1 else group_size
    w_mean = torch.cat(
        [g / (g.amax(1, keepdim=True) + 1e-6) for g in w.abs().split(size, dim=1)], 1
    ).mean(0)
    best, best_scale = float("inf"), None
    for ratio in torch.arange(AWQ_GRID) / AWQ_GRID:
        s = x_mean.pow(ratio)
        if duo_scaling:
            s = s / (w_mean.pow(1 - ratio) + 1e-4)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = rtn_quantize(w * s, bits, group_size, sym).dequantize() / s
        error = float(((x @ wq.T - reference) ** 2).mean())
        if error < best:
            best, best_scale = error, s
    return best_scale


def awq_clip(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """AutoAWQ's clipping search (``auto_clip``): for each output row and group, the
    bound ``m = r max|w|``, ``r`` in ``1, 0.95, .. 0.55``, that minimises the error of
    the group's share of the output, ``x_g Q(clamp(w_g, -m, m))^T``; ``w`` clamped to
    the best bounds.  Clipping the few largest weights makes every other step finer."""
    n, k = w.shape
    x = _awq_sample(x).reshape(-1, k // group_size, group_size)
    w = w.float().reshape(n, k // group_size, group_size)
    reference = torch.einsum("tgi,ngi->ntg", x, w)
    full = w.abs().amax(-1, keepdim=True)
    best, best_error = full, torch.full_like(full, float("inf"))
    for step in range(int(AWQ_MAX_SHRINK * AWQ_GRID)):
        bound = full * (1 - step / AWQ_GRID)
        clipped = torch.maximum(torch.minimum(w, bound), -bound).reshape(n, k)
        wq = rtn_quantize(clipped, bits, group_size, sym=False).dequantize()
        out = torch.einsum("tgi,ngi->ntg", x, wq.reshape(w.shape))
        error = ((out - reference) ** 2).mean(1)[..., None]
        better = error < best_error
        best, best_error = torch.where(better, bound, best), torch.where(better, error, best_error)
    return torch.maximum(torch.minimum(w, best), -best).reshape(n, k)


@torch.no_grad()
def quantize_layer(
    layer,
    inputs,
    method,
    bits,
    group_size,
    sym,
    act_order,
    duo_scaling=True,
    apply_clip=True,
    mse=False,
    true_sequential=False,
    checkpoint_format=None,
):
    """Quantize the decoder ``layer`` given its calibration ``inputs``; its projections
    then hold their dequantized weights.  Returns HF name -> `IntWeight`, every zero
    point one ``checkpoint_format`` (by default `default_format`'s) can store.

    ``awq-gptq`` is AWQ's scaling (no clipping: GPTQ does the rounding) followed by GPTQ,
    llm-compressor's recipe of an ``AWQModifier`` then a ``GPTQModifier`` (AWQ's paper,
    §5, finds the two orthogonal).  With ``true_sequential`` (AutoGPTQ's option), the
    groups of `TRUE_SEQUENTIAL` are quantized in turn, each on inputs collected again
    through the groups already quantized; without it every projection's inputs come
    from the unquantized layer."""
    projections = _projections(layer)
    min_zero = min_zero_point(checkpoint_format or default_format(method))
    seen = _collect(layer, inputs) if method != "rtn" else {}
    if method in ("awq", "awq-gptq"):
        _awq_scale(layer, seen, bits, group_size, duo_scaling, sym)
    quantized = {}
    steps = TRUE_SEQUENTIAL if true_sequential else (tuple(projections),)
    for i, names in enumerate(steps):
        if i > 0:  # what the next group sees through the ones already quantized
            seen = _collect(layer, inputs)
        for name in names:
            linear, w = projections[name], projections[name].weight.float()
            # AutoAWQ clips neither q nor k: their error meets in q k^T, not in one output.
            if method == "awq" and apply_clip and name not in AWQ_UNCLIPPED:
                w = awq_clip(w, seen[name], bits, group_size)
            if method in ("gptq", "awq-gptq"):
                hessian = 2 * seen[name].T @ seen[name] / len(seen[name])
                quantized[name] = gptq_quantize(
                    w, hessian, bits, group_size, sym, act_order, mse=mse, min_zero=min_zero
                )
            else:
                quantized[name] = rtn_quantize(w, bits, group_size, sym, mse, min_zero)
            linear.weight.copy_(quantized[name].dequantize(linear.weight.dtype))
    return quantized


def quantize_checkpoint(
    model_path,
    out,
    method: str = "gptq",
    bits: int = 4,
    group_size: int = 128,
    sym: bool = True,
    act_order: bool = False,
    num_samples: int = 64,
    seq_len: int = 256,
    num_threads: int = 1,
    mse: bool = False,
    true_sequential: bool = False,
    checkpoint_format: str | None = None,
) -> Path:
    """Quantize the checkpoint in ``model_path`` with ``method`` and write it to ``out``
    in Hugging Face's ``checkpoint_format``, GPTQ's or AWQ's (by default GPTQ's for
    rtn, gptq and awq-gptq, AWQ's for awq), torch on ``num_threads`` threads (module
    docstring).  The awq method's zero points are always asymmetric.  AWQ's format
    stores zero points of 0, which GPTQ's cannot (`min_zero_point`), and has no
    ``g_idx``, so no act-order.  ``mse`` searches each group's range (`fit_grid`);
    ``true_sequential`` calibrates each projection group on the ones quantized before
    it (`quantize_layer`)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    checkpoint_format = checkpoint_format or default_format(method)
    if checkpoint_format not in FORMATS:
        raise ValueError(f"checkpoint_format must be one of {FORMATS}, got {checkpoint_format!r}")
    if group_size == -1 and checkpoint_format == "awq":
        raise ValueError("group_size -1 (one group per row) needs GPTQ's format, not AWQ's")
    if act_order and checkpoint_format == "awq":
        raise ValueError(
            "act_order (desc_act) needs GPTQ's format: AWQ's has no g_idx, its groups "
            "are always in column order"
        )
    if bits != 4:
        raise ValueError(f"bits must be 4 (the formats minipaged writes), got {bits!r}")
    if group_size not in (-1, 32, 64, 128):
        raise ValueError(f"group_size must be -1, 32, 64 or 128, got {group_size!r}")
    if act_order and method not in GPTQ_METHODS:
        raise ValueError(f"act_order (desc_act) is GPTQ's ({GPTQ_METHODS}), not {method!r}'s")
    if true_sequential and method not in GPTQ_METHODS:
        raise ValueError(f"true_sequential is GPTQ's ({GPTQ_METHODS}), not {method!r}'s")
    if mse and method == "awq":
        raise ValueError("mse is the GPTQ format's (rtn, gptq, awq-gptq); awq clips instead")
    model_path, out = Path(model_path), Path(out)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, local_files_only=True
    ).eval()
    saved_dtype = getattr(model.config, "dtype", None) or torch.float32
    if isinstance(saved_dtype, str):
        saved_dtype = getattr(torch, saved_dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    samples = calibration_samples(tokenizer, num_samples, seq_len)
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        quantized = _quantize_layers(
            model,
            samples,
            method,
            bits,
            group_size,
            sym,
            act_order,
            mse=mse,
            true_sequential=true_sequential,
            checkpoint_format=checkpoint_format,
        )
    finally:
        torch.set_num_threads(threads)
    sym = sym and method != "awq"
    options = {"mse": mse, "true_sequential": true_sequential}
    _write(
        model,
        model_path,
        out,
        quantized,
        method,
        checkpoint_format,
        bits,
        group_size,
        sym,
        act_order,
        saved_dtype,
        options,
    )
    return out


@torch.no_grad()
def _quantize_layers(model, samples, method, bits, group_size, sym, act_order, **options) -> dict:
    """Every decoder layer quantized in turn, each calibrated on the previous ones'
    quantized outputs; HF name -> `IntWeight`."""
    quantized = {}
    # Rounding needs no calibration: no forward pass at all.
    inputs = _layer_inputs(model, samples) if method != "rtn" else None
    for i, layer in enumerate(tqdm(model.model.layers, desc=f"{method} layers", leave=False)):
        for name, weight in quantize_layer(
            layer, inputs, method, bits, group_size, sym and method != "awq", act_order, **options
        ).items():
            quantized[f"model.layers.{i}.{name}"] = weight
        if inputs is not None:
            inputs = _run_layer(layer, inputs)
    return quantized


def _write(
    model, source, out, quantized, method, fmt, bits, group_size, sym, act_order, dtype, options
):
    out.mkdir(parents=True, exist_ok=True)
    pack = formats.pack_awq if fmt == "awq" else formats.pack_gptq
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        prefix = name.rsplit(".", 1)[0]
        if prefix in quantized and name.endswith(".weight"):
            for kind, packed in pack(quantized[prefix]).items():
                tensors[f"{prefix}.{kind}"] = packed
        else:
            tensors[name] = tensor.to(dtype).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    if fmt == "awq":
        config["quantization_config"] = {
            "quant_method": "awq",
            "bits": bits,
            "group_size": group_size,
            "zero_point": True,
            "version": "gemm",
        }
        if method != "awq":  # not keys of the format: how the integers were chosen
            config["quantization_config"].update(options, minipaged_method=method)
    else:
        config["quantization_config"] = {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": sym,
            "checkpoint_format": "gptq",
            "damp_percent": 0.01,
            # AutoGPTQ's true_sequential and GPTQModel's mse, as they record them.
            **options,
            # Not a key of the format: how the integers were chosen, for the reader.
            "minipaged_method": method,
        }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in source.iterdir():  # the tokenizer and generation config
        skip = file.suffix == ".safetensors" or file.name.endswith(".index.json")
        if file.is_file() and not skip and file.name != "config.json":
            shutil.copy(file, out / file.name)
