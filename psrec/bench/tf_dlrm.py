"""The TensorFlow/Keras DLRM of `psrec bench` ("tensorflow"), a standalone script for a TensorFlow env.

It imports only NumPy and TensorFlow (never psrec or torch), so it runs under any Python that has
TensorFlow, typically a separate virtualenv (`psrec bench --tf-python /tmp/tfvenv/bin/python`):

    python psrec/bench/tf_dlrm.py REQUEST.json RESULT.json

REQUEST names two `.npz` files (train, validation) that `tf_system` wrote from psrec's reader: per
split `dense` (R, 13) float32 (already transformed), `labels` (R,), and per sparse feature f
`ids_f` (row numbers, one distinct id per row) and `lengths_f` (R,). The model is the bench's DLRM::

    b = MLP(dense)                        # 13-512-256-D, relu after every layer, (B, D)
    e_f = sum of table_f rows of the bag  # (B, D) each, F = 26
    z = [b, upper_triangle([b, e_1..e_F] [b, e_1..e_F]^T)]   # (B, D + 27 * 26 / 2)
    logit = MLP(z)                        # 512-256-1

trained with Adagrad on the tables (one accumulator per element, as `torch.optim.Adagrad`: duplicate
rows summed, then `a += g**2; w -= lr * g / (sqrt(a) + eps)` on the touched rows only) and Keras Adam
on the MLPs, binary cross-entropy on logits, under `threads` intra-op threads.

With `"precision": "bf16"` (the "tensorflow-bf16" system) the script first sets Keras' global
`mixed_bfloat16` policy: the MLP layers keep fp32 variables and compute in bf16, the tables stay fp32
variables (and their Adagrad fp32), each feature's pooled rows are summed in fp32 and cast once to
bf16, as psrec's and PyTorch's bf16 embedding paths hand their rows to the model (for a bag of one id
the same as Keras' `Embedding` under the policy, which casts the looked-up rows), the interaction and
the top MLP run in bf16, and the logits are cast to fp32 for the loss and the scores. The tables' Adagrad is
TensorFlow's sparse kernel (`ResourceSparseApplyAdagradV2`, what TensorFlow's own pre-Keras-3
optimizers applied to `tf.IndexedSlices`): Keras 3's `Adagrad` computes `sqrt(a + eps)` over the whole
table at every step (130 ms per step for one 1M x 64 table on this machine's 2 threads). Warm-up steps run first (they trace the `tf.function`), then the timed
steps; RESULT gets the rate, CPU rate, best step, peak RSS and the validation scores (the caller
computes the AUC with psrec's metric).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def split_batches(arrays: dict[str, np.ndarray], batch_size: int, num_sparse: int) -> list[dict[str, Any]]:
    """Rows of a split cut into batches: dense, labels, and per feature ids and each id's bag (sample)."""
    rows = arrays["labels"].shape[0]
    starts = [np.concatenate([[0], np.cumsum(arrays[f"lengths_{f}"])]) for f in range(num_sparse)]
    batches = []
    for begin in range(0, rows, batch_size):
        end = min(rows, begin + batch_size)
        ids, bags = [], []
        for f in range(num_sparse):
            lengths = arrays[f"lengths_{f}"][begin:end]
            ids.append(arrays[f"ids_{f}"][starts[f][begin] : starts[f][end]])
            bags.append(np.repeat(np.arange(end - begin, dtype=np.int64), lengths))
        batches.append(
            {
                "dense": arrays["dense"][begin:end],
                "labels": arrays["labels"][begin:end],
                "ids": ids,
                "bags": bags,
            }
        )
    return batches


def run(request: dict[str, Any]) -> dict[str, Any]:
    import tensorflow as tf

    threads = int(request["threads"])
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.random.set_seed(int(request["seed"]))
    keras = tf.keras
    precision = request.get("precision", "fp32")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be fp32 or bf16, not {precision!r}")
    # Keras layers built from here on keep fp32 variables and compute in the policy's dtype.
    keras.mixed_precision.set_global_policy("mixed_bfloat16" if precision == "bf16" else "float32")
    compute = tf.bfloat16 if precision == "bf16" else tf.float32
    dim, sizes = int(request["dim"]), [int(size) for size in request["table_sizes"]]
    num_sparse = len(sizes)
    scale = float(request["init_scale"])
    tables = [
        tf.Variable(tf.random.uniform((size, dim), -scale, scale), name=f"table_{f}")
        for f, size in enumerate(sizes)
    ]

    def mlp(widths: list[int], last_activation: str | None) -> Any:
        layers = [keras.layers.Dense(w, activation="relu") for w in widths[:-1]]
        return keras.Sequential([*layers, keras.layers.Dense(widths[-1], activation=last_activation)])

    bottom = mlp([*request["bottom_hidden_sizes"], dim], "relu")
    top = mlp([*request["top_hidden_sizes"], 1], None)
    bottom.build((None, 13))
    pairs = (num_sparse + 1) * num_sparse // 2
    top.build((None, dim + pairs))
    upper = np.triu_indices(num_sparse + 1, k=1)
    flat_upper = tf.constant(upper[0] * (num_sparse + 1) + upper[1], dtype=tf.int32)
    dense_weights = bottom.trainable_variables + top.trainable_variables
    accumulators = [
        tf.Variable(tf.zeros_like(table), name=f"accumulator_{f}") for f, table in enumerate(tables)
    ]
    sparse_lr, epsilon = tf.constant(float(request["sparse_lr"])), tf.constant(1e-10)
    dense_optimizer = keras.optimizers.Adam(learning_rate=float(request["dense_lr"]))
    dense_optimizer.build(dense_weights)

    def sparse_adagrad(table: Any, accumulator: Any, grad: Any) -> None:
        """Adagrad on the rows of `grad` (tf.IndexedSlices): duplicates summed, then one update each."""
        rows, positions = tf.unique(grad.indices)
        summed = tf.math.unsorted_segment_sum(grad.values, positions, tf.shape(rows)[0])  # (n, D)
        tf.raw_ops.ResourceSparseApplyAdagradV2(
            var=table.handle,
            accum=accumulator.handle,
            lr=sparse_lr,
            epsilon=epsilon,
            grad=summed,
            indices=rows,
        )

    def logits(dense: Any, ids: list[Any], bags: list[Any], batch: Any) -> Any:
        b = bottom(dense)  # (B, D)
        pooled = [  # fp32 sums of fp32 rows, cast once to the compute dtype
            tf.cast(tf.math.unsorted_segment_sum(tf.gather(table, feature_ids), feature_bags, batch), compute)
            for table, feature_ids, feature_bags in zip(tables, ids, bags, strict=True)
        ]
        vectors = tf.stack([b, *pooled], axis=1)  # (B, F + 1, D)
        products = tf.reshape(tf.matmul(vectors, vectors, transpose_b=True), (batch, -1))  # (B, (F+1)^2)
        z = tf.concat([b, tf.gather(products, flat_upper, axis=1)], axis=1)  # (B, D + pairs)
        return tf.cast(tf.squeeze(top(z), axis=1), tf.float32)  # (B,) logits in fp32 for the loss

    @tf.function
    def train_step(dense: Any, labels: Any, ids: list[Any], bags: list[Any]) -> Any:
        batch = tf.shape(labels)[0]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(
                tf.nn.sigmoid_cross_entropy_with_logits(labels, logits(dense, ids, bags, batch))
            )
        grads = tape.gradient(loss, tables + dense_weights)  # tables: tf.IndexedSlices of gathered rows
        for table, accumulator, grad in zip(tables, accumulators, grads[:num_sparse], strict=True):
            sparse_adagrad(table, accumulator, grad)
        dense_optimizer.apply_gradients(zip(grads[num_sparse:], dense_weights, strict=True))
        return loss

    @tf.function
    def predict(dense: Any, ids: list[Any], bags: list[Any]) -> Any:
        return tf.sigmoid(logits(dense, ids, bags, tf.shape(dense)[0]))

    def tensors(batch: dict[str, Any]) -> tuple[Any, Any, list[Any], list[Any]]:
        return (
            tf.constant(batch["dense"], tf.float32),
            tf.constant(batch["labels"], tf.float32),
            [tf.constant(ids, tf.int64) for ids in batch["ids"]],
            [tf.constant(bags, tf.int64) for bags in batch["bags"]],
        )

    batch_size, warmup, steps = (
        int(request["batch_size"]),
        int(request["warmup_steps"]),
        int(request["steps"]),
    )
    with np.load(request["train"]) as arrays:
        train = [tensors(b) for b in split_batches(dict(arrays), batch_size, num_sparse)]
    with np.load(request["validation"]) as arrays:
        validation = [tensors(b) for b in split_batches(dict(arrays), 16384, num_sparse)]
    for index in range(warmup):
        train_step(*train[index % len(train)])
    start, cpu_start = time.perf_counter(), time.process_time()
    samples, step_rates = 0, []
    for index in range(warmup, warmup + steps):
        dense, labels, ids, bags = train[index % len(train)]
        began = time.perf_counter()
        train_step(dense, labels, ids, bags).numpy()  # .numpy(): the step has finished
        step_rates.append(int(labels.shape[0]) / (time.perf_counter() - began))
        samples += int(labels.shape[0])
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    scores = [predict(dense, ids, bags).numpy() for dense, _, ids, bags in validation]
    return {
        "samples_per_second": samples / seconds,
        "samples_per_cpu_second": samples / max(cpu_seconds, 1e-9),
        "best_step_samples_per_second": max(step_rates),
        "timed_seconds": seconds,
        "timed_samples": samples,
        "peak_rss_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
        "validation_scores": np.concatenate(scores).astype(float).tolist() if scores else [],
        "tensorflow": tf.__version__,
        "precision": precision,
    }


def main(request_path: str, result_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    Path(result_path).write_text(json.dumps(run(request)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
