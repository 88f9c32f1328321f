"""HSTU training speed against the reference implementation: tokens/s of psrec's HSTU and of generative-recommenders' HSTU, same shape, same batches.

    python -m psrec.bench.hstu_reference_bench --reference-dir /tmp/gr-ref \\
        --reference-python /tmp/torchrec-venv/bin/python [--config regular|large] [--steps 5] [--rounds 3]

``--reference-dir`` is a checkout of facebookresearch/generative-recommenders (its
research/modeling/sequential/hstu.py and what that needs; nothing of it is copied here), and
``--reference-python`` a Python with torch, fbgemm_gpu (its CPU build will do) and gin-config. The
shape is the reference's ML-1M config, read from its gin file: ``regular`` is
configs/ml-1m/hstu-sampled-softmax-n128-final.gin (2 blocks x 1 head, dqk = dv = 50), ``large``
hstu-sampled-softmax-n128-large-final.gin (8 blocks x 2 heads, dqk = dv = 25); both item dim 50,
max length 200, batch 128, dropout 0.2, L2-normalised embeddings, temperature 0.05, sampled softmax
over 128 negatives, Adam(W) lr 1e-3 betas (0.9, 0.98), no weight decay; relative position bias and
no time bias (the data has no timestamps).

The batches: users of ``--data`` (``user item`` lines, ML-1M: 3,416 items) drawn at random (fixed
seed), each with its real items: ``min(count - 1, 200)`` positions, its last items but one as the
input and each next item as the target. Every system trains on the same batches (written once as a
`.npz`): one warm-up step, then ``--steps`` timed steps, each forward + sampled-softmax loss +
backward + Adam step of the dense parameters and the item table. Tokens/s counts real (non-padded)
positions trained per second.

- psrec: `psrec.models.HSTU` (jagged blocks), the item table a plain in-memory tensor: the batch's
  distinct items are gathered as leaf rows (the rows a trainer pulls), the sequences built from them
  with the accidental-hit numbers the trainer passes (`ModelInput.ids`), the rows' gradient copied
  into the table's and one `torch.optim.Adam` stepping the model and the whole table (the
  ``lazy: false`` Adam of examples/ml1m_hstu.yaml). The negatives: 128 per user uniform over all
  items (`psrec.data.sequences.sample_negatives`, the examples' ``negatives_from: all``), each
  position picking its own 128 from the batch's draws (``--negatives-per position``, the examples'
  setting) or the user's positions sharing them (``user``).
- reference: `psrec/bench/hstu_reference_worker.py` under ``--reference-python``: the reference's
  own modules, item table (``nn.Embedding``), negatives sampler (128 per position) and
  SampledSoftmaxLoss, its step as its trainer runs it; that file says which CPU paths it takes.

Each run is a fresh process with one torch thread, rounds interleaved (psrec, reference, psrec, ...);
reported: the median over rounds of tokens/s (wall clock) and of tokens per CPU second (steadier on a
busy machine), the ratio psrec / reference, the parameter counts of both by group, the machine and
both processes' torch versions.
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from psrec.data.sequences import InteractionData, load_interactions, sample_negatives
from psrec.machine import cpu_model, isa_features
from psrec.models import HSTU, ModelInput
from psrec.threads import set_thread_counts

logger = logging.getLogger(__name__)

CONFIGS = {
    "regular": "configs/ml-1m/hstu-sampled-softmax-n128-final.gin",
    "large": "configs/ml-1m/hstu-sampled-softmax-n128-large-final.gin",
}
WORKER = Path(__file__).with_name("hstu_reference_worker.py")
DEFAULT_DATA = "../shared/data/ml-1m/ml-1m.txt"
WARMUP = 1
THREADS = 1
SEED = 0
BETAS = (0.9, 0.98)  # the reference trainer's (research/trainer/train.py)
GROUPS = ("items", "positions", "projections", "position bias", "time bias")
Bias = Literal["position", "time-and-position"]


def read_gin_bindings(text: str) -> dict[str, Any]:
    """``configurable.parameter = literal`` lines of a gin file as a dict (comments and blank lines
    skipped). Only literal values are read (numbers, strings, booleans), as in the ML-1M configs."""
    bindings = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, equals, value = line.partition("=")
        if not equals:
            raise ValueError(f"gin line {number}: expected 'name = value', got {raw!r}")
        try:
            bindings[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError) as error:
            raise ValueError(f"gin line {number}: {value.strip()!r} is not a literal") from error
    return bindings


@dataclass(frozen=True)
class HSTUShape:
    """What the bench takes from a reference ML-1M gin file."""

    max_length: int
    batch_size: int
    item_embedding_dim: int
    dropout: float
    num_blocks: int
    num_heads: int
    dqk: int
    dv: int
    num_negatives: int
    temperature: float
    learning_rate: float
    weight_decay: float
    l2_norm_eps: float

    @classmethod
    def from_bindings(cls, bindings: dict[str, Any]) -> HSTUShape:
        """The shape of a config psrec can run the same way; ValueError naming what differs or is missing."""
        expected = {
            "train_fn.main_module": "HSTU",
            "train_fn.loss_module": "SampledSoftmaxLoss",
            "train_fn.sampling_strategy": "local",
            "train_fn.user_embedding_norm": "l2_norm",
            "train_fn.item_l2_norm": True,
            "train_fn.interaction_module_type": "DotProduct",
        }
        wrong = {name: bindings.get(name) for name, value in expected.items() if bindings.get(name) != value}
        if wrong:
            raise ValueError(f"the config is not an HSTU sampled-softmax config psrec matches: {wrong}")
        names = {
            "max_length": "train_fn.max_sequence_length",
            "batch_size": "train_fn.local_batch_size",
            "item_embedding_dim": "train_fn.item_embedding_dim",
            "dropout": "train_fn.dropout_rate",
            "num_blocks": "hstu_encoder.num_blocks",
            "num_heads": "hstu_encoder.num_heads",
            "dqk": "hstu_encoder.dqk",
            "dv": "hstu_encoder.dv",
            "num_negatives": "train_fn.num_negatives",
            "temperature": "train_fn.temperature",
            "learning_rate": "train_fn.learning_rate",
            "weight_decay": "train_fn.weight_decay",
            "l2_norm_eps": "train_fn.l2_norm_eps",
        }
        missing = sorted(name for name in names.values() if name not in bindings)
        if missing:
            raise ValueError(f"the config does not bind {missing}")
        linear_dropout = bindings.get("hstu_encoder.linear_dropout_rate", 0.0)
        if linear_dropout != bindings["train_fn.dropout_rate"]:
            raise ValueError(
                f"psrec's HSTU has one dropout; the config's input dropout {bindings['train_fn.dropout_rate']} "
                f"differs from its linear dropout {linear_dropout}"
            )
        return cls(**{field: bindings[name] for field, name in names.items()})


@dataclass(frozen=True)
class Batches:
    """Training batches of whole user histories, oldest item first.

    ``items`` (S, B, L + 1): row b of step s holds the ``lengths[s, b]`` input items, then the last
    target, then zeros; the targets are ``items[s, b, 1 : length + 1]``. ``negatives`` (S, B, N):
    psrec's draws per user (the reference draws its own)."""

    items: np.ndarray
    lengths: np.ndarray
    negatives: np.ndarray

    def save(self, path: Path) -> None:
        np.savez(path, items=self.items, lengths=self.lengths, negatives=self.negatives)


def make_batches(
    data: InteractionData, *, steps: int, batch_size: int, max_length: int, num_negatives: int, seed: int
) -> Batches:
    """`steps` batches of `batch_size` users each (drawn without replacement within a batch; users
    with one item skipped), each with its last ``min(count - 1, max_length)`` positions."""
    rng = np.random.default_rng(seed)
    counts = np.diff(data.offsets)
    eligible = np.flatnonzero(counts >= 2)
    items = np.zeros((steps, batch_size, max_length + 1), dtype=np.int64)
    lengths = np.zeros((steps, batch_size), dtype=np.int64)
    negatives = np.zeros((steps, batch_size, num_negatives), dtype=np.int64)
    for step in range(steps):
        for row, user in enumerate(rng.choice(eligible, size=batch_size, replace=False)):
            history = data.history(int(user))
            length = min(history.size - 1, max_length)
            items[step, row, : length + 1] = history[-(length + 1) :]
            lengths[step, row] = length
            negatives[step, row] = sample_negatives(
                rng, num_negatives, data.num_items, history[:0]
            )  # all items
    return Batches(items, lengths, negatives)


def left_padded(items: np.ndarray, lengths: np.ndarray, max_length: int) -> tuple[np.ndarray, ...]:
    """One step's (B, L + 1) items (see `Batches`) as psrec's left-padded (B, L) inputs, targets and mask."""
    batch = items.shape[0]
    columns = np.arange(max_length)
    mask = columns[None, :] >= (max_length - lengths)[:, None]  # (B, L), real items right-aligned
    rows = np.broadcast_to(np.arange(batch)[:, None], mask.shape)[mask]
    position = (columns[None, :] - (max_length - lengths)[:, None])[mask]  # index from the oldest item
    inputs = np.zeros((batch, max_length), dtype=np.int64)
    targets = np.zeros((batch, max_length), dtype=np.int64)
    inputs[mask] = items[rows, position]
    targets[mask] = items[rows, position + 1]
    return inputs, targets, mask


def psrec_parameter_groups(model: HSTU, table: torch.Tensor) -> dict[str, int]:
    """Parameter counts by the bench's groups (`GROUPS`), the item table's rows included."""
    groups = dict.fromkeys(GROUPS, 0)
    groups["items"] = table.numel()
    for name, parameter in model.named_parameters():
        if name.endswith("position_weights"):
            group = "position bias"
        elif name.endswith("time_weights"):
            group = "time bias"
        elif name == "embedding.positions":
            group = "positions"
        else:
            group = "projections"
        groups[group] += parameter.numel()
    return groups


def pulled_input(
    table: torch.Tensor, inputs: np.ndarray, targets: np.ndarray, mask: np.ndarray, negatives: np.ndarray
) -> tuple[ModelInput, torch.Tensor, torch.Tensor]:
    """psrec's model input from a (items, D) table (row = id - 1), as a trainer builds it from pulled rows.

    inputs, targets, mask (B, L) left-padded (`left_padded`), negatives (B, N) item ids. Returns the
    input, the leaf rows (U, D) of the batch's distinct items (their ``.grad`` after backward is what a
    trainer pushes) and those rows' numbers in `table` (U,)."""
    dim = table.shape[1]
    real = mask.reshape(-1)
    tokens = int(real.sum())
    ids = np.concatenate([inputs.reshape(-1)[real], targets.reshape(-1)[real], negatives.reshape(-1)])
    unique, inverse = np.unique(ids, return_inverse=True)
    table_rows = torch.from_numpy(unique - 1)
    rows = table.detach()[table_rows].requires_grad_(True)  # (U, D)
    padded_rows = torch.cat([rows, rows.new_zeros(1, dim)])  # padding reads the zero row

    def numbers(part: np.ndarray) -> np.ndarray:  # (B, L): each item's row among `rows`, -1 at padding
        out = np.full(real.size, -1, dtype=np.int64)
        out[real] = part
        return out.reshape(mask.shape)

    def gather(part_numbers: np.ndarray) -> torch.Tensor:  # (..., D)
        index = np.where(part_numbers >= 0, part_numbers, unique.size).reshape(-1)
        return padded_rows.index_select(0, torch.from_numpy(index)).view(*part_numbers.shape, dim)

    input_numbers, target_numbers = numbers(inverse[:tokens]), numbers(inverse[tokens : 2 * tokens])
    negative_numbers = inverse[2 * tokens :].reshape(negatives.shape)  # (B, N)
    batch = mask.shape[0]
    inp = ModelInput(
        torch.zeros(batch, 0),
        torch.zeros(batch, 0, dim),
        None,
        {"seq": gather(input_numbers), "pos": gather(target_numbers), "negatives": gather(negative_numbers)},
        {"seq": torch.from_numpy(mask)},
        ids={"pos": torch.from_numpy(target_numbers), "negatives": torch.from_numpy(negative_numbers)},
    )
    return inp, rows, table_rows


def run_psrec(request: dict[str, Any]) -> dict[str, Any]:
    """psrec's side of one round, in this process (a fresh one: `run_psrec_file`)."""
    set_thread_counts(request["threads"])
    shape = HSTUShape(**request["config"])
    dim, max_length = shape.item_embedding_dim, shape.max_length
    torch.manual_seed(request["seed"])
    model = HSTU(
        dim,
        max_length=max_length,
        num_blocks=shape.num_blocks,
        num_heads=shape.num_heads,
        attention_dim=shape.dqk,
        linear_dim=shape.dv,
        dropout=shape.dropout,
        temperature=shape.temperature,
        loss="sampled_softmax",
        negatives_per=request["negatives_per"],
    )
    table = torch.nn.Parameter(torch.empty(request["num_items"], dim).normal_(0.0, 0.02))  # row = id - 1
    optimizer = torch.optim.Adam(
        [*model.parameters(), table], lr=shape.learning_rate, betas=BETAS, weight_decay=shape.weight_decay
    )
    model.train()
    arrays = np.load(request["batches"])
    lengths = arrays["lengths"]
    batches = [
        (*left_padded(arrays["items"][step], lengths[step], max_length), arrays["negatives"][step])
        for step in range(lengths.shape[0])
    ]

    def one_step(inputs: np.ndarray, targets: np.ndarray, mask: np.ndarray, negatives: np.ndarray) -> float:
        optimizer.zero_grad()
        inp, rows, table_rows = pulled_input(table, inputs, targets, mask, negatives)
        loss, _ = model.loss(inp)
        loss.backward()
        assert rows.grad is not None
        table.grad = torch.zeros_like(table).index_copy_(0, table_rows, rows.grad)  # the push
        optimizer.step()
        return float(loss.detach())

    warmup = request["warmup"]
    losses = [one_step(*batch) for batch in batches[:warmup]]
    start, cpu_start = time.perf_counter(), time.process_time()
    losses += [one_step(*batch) for batch in batches[warmup:]]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "steps": len(batches) - warmup,
        "tokens": int(lengths[warmup:].sum()),
        "losses": losses,
        "parameters": psrec_parameter_groups(model, table),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_psrec_file(request_path: str, result_path: str) -> None:
    """`run_psrec` from and to JSON files: what the fresh psrec process runs."""
    result = run_psrec(json.loads(Path(request_path).read_text()))
    Path(result_path).write_text(json.dumps(result))


def _run_process(command: list[str], result: Path, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(f"{command[0]} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return dict(json.loads(result.read_text()))


def run_round(
    request: dict[str, Any], *, reference_python: str, workdir: Path, timeout: float
) -> dict[str, Any]:
    """One round: psrec, then the reference, each in a fresh process; their results by system."""
    path = workdir / "request.json"
    path.write_text(json.dumps(request))
    psrec_result, reference_result = workdir / "psrec.json", workdir / "reference.json"
    for stale in (psrec_result, reference_result):
        stale.unlink(missing_ok=True)
    code = f"from psrec.bench.hstu_reference_bench import run_psrec_file; run_psrec_file({str(path)!r}, {str(psrec_result)!r})"
    return {
        "psrec": _run_process([sys.executable, "-c", code], psrec_result, timeout),
        "reference": _run_process(
            [reference_python, str(WORKER), str(path), str(reference_result)], reference_result, timeout
        ),
    }


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds per system, and the ratio psrec / reference (the median of each round's)."""
    out: dict[str, Any] = {}
    for system in ("psrec", "reference"):
        results = [round_[system] for round_ in rounds]
        out[system] = {
            "tokens_per_second": statistics.median(r["tokens"] / r["seconds"] for r in results),
            "tokens_per_cpu_second": statistics.median(r["tokens"] / r["cpu_seconds"] for r in results),
            "steps_per_second": statistics.median(r["steps"] / r["seconds"] for r in results),
            "tokens_per_step": results[0]["tokens"] / results[0]["steps"],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
            "losses": results[-1]["losses"],
        }
    for key, clock in (("tokens_per_second", "seconds"), ("tokens_per_cpu_second", "cpu_seconds")):
        out[f"ratio_{key}"] = statistics.median(
            (r["psrec"]["tokens"] / r["psrec"][clock]) / (r["reference"]["tokens"] / r["reference"][clock])
            for r in rounds
        )
    return out


def report(
    args: argparse.Namespace,
    shape: HSTUShape,
    rounds: list[dict[str, Any]],
    summary: dict[str, Any],
    load: tuple[float, float, float],
) -> str:
    """The printed report: settings, machine, versions, parameter counts, rates and the ratio."""
    first = rounds[0]
    features = ", ".join(isa_features()) or "no AVX2"
    lines = [
        f"HSTU, generative-recommenders' {CONFIGS[args.config]}: {shape.num_blocks} blocks x "
        f"{shape.num_heads} heads, dqk {shape.dqk}, dv {shape.dv}, item dim {shape.item_embedding_dim}, "
        f"length {shape.max_length}, batch {shape.batch_size}, {shape.num_negatives} negatives, "
        f"dropout {shape.dropout}, fp32; relative bias: psrec position, reference {args.reference_bias}",
        f"CPU {cpu_model()} ({features}), {os.cpu_count()} logical cores, load average "
        f"{load[0]:.2f} before, {os.getloadavg()[0]:.2f} after; torch threads: psrec "
        f"{first['psrec']['threads']}, reference {first['reference']['threads']}",
        f"psrec: torch {first['psrec']['torch']}, negatives per {args.negatives_per}; reference: torch "
        f"{first['reference']['torch']}, fbgemm_gpu {first['reference']['fbgemm_gpu']}, {args.reference_dir}",
        f"{args.steps} timed steps after {WARMUP} warm-up, {args.rounds} round(s) interleaved, medians; "
        f"{summary['psrec']['tokens_per_step']:,.0f} real tokens per step",
        "",
        f"{'parameters':<14}{'psrec':>10}{'reference':>11}",
    ]
    counts = {system: first[system]["parameters"] for system in ("psrec", "reference")}
    for group in (*GROUPS, "total"):
        if group == "total":
            values = [sum(counts[system].values()) for system in ("psrec", "reference")]
        else:
            values = [counts[system][group] for system in ("psrec", "reference")]
        lines.append(f"{group:<14}{values[0]:>10,}{values[1]:>11,}")
    lines += [
        "",
        f"{'system':<11}{'tokens/s':>10}{'tokens/CPU-s':>14}{'steps/s':>9}{'peak RSS':>10}  loss first..last",
    ]
    for system in ("psrec", "reference"):
        result = summary[system]
        lines.append(
            f"{system:<11}{result['tokens_per_second']:>10,.0f}{result['tokens_per_cpu_second']:>14,.0f}"
            f"{result['steps_per_second']:>9.3f}{result['peak_rss_mb']:>8,.0f}MB  "
            f"{result['losses'][0]:.3f}..{result['losses'][-1]:.3f}"
        )
    lines.append(
        f"psrec / reference: {summary['ratio_tokens_per_second']:.2f}x tokens/s, "
        f"{summary['ratio_tokens_per_cpu_second']:.2f}x tokens per CPU second"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reference-dir", required=True, help="a generative-recommenders checkout")
    parser.add_argument(
        "--reference-python", required=True, help="a Python with torch, fbgemm_gpu, gin-config"
    )
    parser.add_argument("--config", choices=sorted(CONFIGS), default="regular")
    parser.add_argument("--steps", type=int, default=5, help=f"timed steps per run (after {WARMUP} warm-up)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", default=DEFAULT_DATA, help="'user item' lines (ML-1M)")
    parser.add_argument("--negatives-per", choices=["user", "position"], default="position", help="psrec's")
    parser.add_argument(
        "--reference-bias",
        choices=["position", "time-and-position"],
        default="position",
        help="the reference's relative bias (see psrec/bench/hstu_reference_worker.py)",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--json", help="write every round's results and the summary here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    gin_file = Path(args.reference_dir) / CONFIGS[args.config]
    if not gin_file.is_file():
        parser.error(f"{gin_file} not found: --reference-dir must be a generative-recommenders checkout")
    if not Path(args.data).is_file():
        parser.error(f"{args.data} not found (--data)")
    shape = HSTUShape.from_bindings(read_gin_bindings(gin_file.read_text()))
    data = load_interactions([args.data])
    batches = make_batches(
        data,
        steps=WARMUP + args.steps,
        batch_size=shape.batch_size,
        max_length=shape.max_length,
        num_negatives=shape.num_negatives,
        seed=SEED,
    )
    rounds = []
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="psrec-hstu-reference-") as tmp:
        workdir = Path(tmp)
        batches.save(workdir / "batches.npz")
        request = {
            "config": asdict(shape),
            "num_items": data.num_items,
            "batches": str(workdir / "batches.npz"),
            "warmup": WARMUP,
            "threads": THREADS,
            "seed": SEED,
            "negatives_per": args.negatives_per,
            "bias": args.reference_bias,
            "reference_dir": str(Path(args.reference_dir).resolve()),
            "gin_file": str(gin_file.resolve()),
        }
        for number in range(args.rounds):
            rounds.append(
                run_round(
                    request, reference_python=args.reference_python, workdir=workdir, timeout=args.timeout
                )
            )
            logger.info(
                "round %d: psrec %.0f, reference %.0f tokens/s",
                number + 1,
                *(rounds[-1][s]["tokens"] / rounds[-1][s]["seconds"] for s in ("psrec", "reference")),
            )
    for round_ in rounds:
        if round_["psrec"]["tokens"] != round_["reference"]["tokens"]:
            raise RuntimeError(f"the systems trained different token counts: {round_}")
    summary = summarize(rounds)
    print(report(args, shape, rounds, summary, load))  # noqa: T201 - a command's report
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
