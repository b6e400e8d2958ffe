"""Write the committed corpus of hostile input files (tests/fuzz/corpus/): run it to regenerate.

    .venv/bin/python tests/fuzz/make_corpus.py

Each file is one way a hostile or careless user can break a reader: structure (nesting, duplicate keys, huge
integers, encodings, sizes), types (booleans as numbers, NaN / inf, strings), and values (zero, negative,
absurd). The cases that run them are in ``cases.py``. File names say what each one is.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CORPUS = Path(__file__).resolve().parent / "corpus"
BIG_INT = "9" * 5000
"""A 5,000-digit integer (Python refuses to convert more than 4,300 digits by default)."""
NAN, INF = float("nan"), float("inf")


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _set(data: dict, dotted: str, value) -> dict:
    out = copy.deepcopy(data)
    node = out
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    if value is _DELETE:
        node.pop(keys[-1], None)
    elif isinstance(node, list):
        node[int(keys[-1])] = value
    else:
        node[keys[-1]] = value
    return out


_DELETE = object()


class _Big:
    """A marker for the 5,000-digit integer (written as text, yaml / json cannot produce it from an int)."""


def _dump_yaml(data) -> str:
    text = yaml.safe_dump(data, sort_keys=False, width=1000, allow_unicode=True)
    return text.replace("BIGINT_MARKER", BIG_INT).replace("'" + BIG_INT + "'", BIG_INT)


def _dump_json(data) -> str:
    return json.dumps(data, indent=1, allow_nan=True).replace('"BIGINT_MARKER"', BIG_INT)


def _value(v):
    return "BIGINT_MARKER" if v is _Big else v


MODEL_MUTATIONS = {
    "num_layers-true": ("num_layers", True),
    "num_layers-false": ("num_layers", False),
    "num_layers-zero": ("num_layers", 0),
    "num_layers-negative": ("num_layers", -4),
    "num_layers-fraction": ("num_layers", 2.5),
    "num_layers-string": ("num_layers", "four"),
    "num_layers-null": ("num_layers", None),
    "num_layers-list": ("num_layers", [4]),
    "num_layers-nan": ("num_layers", NAN),
    "num_layers-inf": ("num_layers", INF),
    "num_layers-1e9": ("num_layers", 1_000_000_000),
    "num_layers-1e7": ("num_layers", 10_000_000),
    "num_layers-1e18": ("num_layers", 10**18),
    "num_layers-bigint": ("num_layers", _Big),
    "hidden_size-true": ("hidden_size", True),
    "hidden_size-zero": ("hidden_size", 0),
    "hidden_size-negative": ("hidden_size", -64),
    "hidden_size-nan": ("hidden_size", NAN),
    "hidden_size-1e30": ("hidden_size", 10**30),
    "hidden_size-bigint": ("hidden_size", _Big),
    "vocab_size-true": ("vocab_size", True),
    "vocab_size-negative": ("vocab_size", -1),
    "vocab_size-1e20": ("vocab_size", 10**20),
    "max_seq_len-zero": ("max_seq_len", 0),
    "max_seq_len-true": ("max_seq_len", True),
    "num_heads-zero": ("attention.num_heads", 0),
    "num_heads-true": ("attention.num_heads", True),
    "num_heads-1e18": ("attention.num_heads", 10**18),
    "num_kv_heads-three": ("attention.num_kv_heads", 3),
    "num_kv_heads-zero": ("attention.num_kv_heads", 0),
    "attention-kind-bogus": ("attention.kind", "xyz"),
    "attention-list": ("attention", [1, 2]),
    "head_dim-negative": ("attention.head_dim", -8),
    "num_experts-zero": ("moe.num_experts", 0),
    "num_experts-true": ("moe.num_experts", True),
    "num_experts-1e12": ("moe.num_experts", 10**12),
    "top_k-above-experts": ("moe.top_k", 9),
    "top_k-zero": ("moe.top_k", 0),
    "expert-intermediate-nan": ("moe.expert.intermediate_size", NAN),
    "expert-intermediate-true": ("moe.expert.intermediate_size", True),
    "expert-intermediate-zero": ("moe.expert.intermediate_size", 0),
    "expert-gated-string": ("moe.expert.gated", "maybe"),
    "moe-explicit-100": ("moe.layers.explicit", [100]),
    "moe-explicit-negative": ("moe.layers.explicit", [-1]),
    "moe-explicit-string": ("moe.layers.explicit", "all"),
    "moe-explicit-bool": ("moe.layers.explicit", [True]),
    "moe-explicit-huge": ("moe.layers.explicit", [10**12]),
    "moe-every-zero": ("moe.layers.every", 0),
    "moe-capacity-nan": ("moe.capacity_factor", NAN),
    "moe-capacity-inf": ("moe.capacity_factor", INF),
    "moe-capacity-negative": ("moe.capacity_factor", -1.0),
    "moe-shared-negative": ("moe.num_shared_experts", -2),
    "moe-shared-1e15": ("moe.num_shared_experts", 10**15),
    "moe-string": ("moe", "yes"),
    "norm-per-layer-negative": ("norm.per_layer", -1),
    "norm-per-layer-1e12": ("norm.per_layer", 10**12),
    "norm-kind-bogus": ("norm.kind", "batchnorm"),
    "name-number": ("name", 5),
    "name-empty": ("name", ""),
    "name-null": ("name", None),
    "source-missing": ("source", _DELETE),
    "unknown-field": ("flux_capacitor", 1.21),
    "tie-embeddings-string": ("tie_embeddings", "false"),
}

PLATFORM_MUTATIONS = {
    "no-links": ("node.link_classes", []),
    "no-scopes": ("network.scopes", {}),
    "scopes-list": ("network.scopes", []),
    "num_nics-zero": ("node.num_nics", 0),
    "nic_bandwidth-zero": ("node.nic_bandwidth_GBps", 0),
    "nic_bandwidth-nan": ("node.nic_bandwidth_GBps", NAN),
    "num_nics-true": ("node.num_nics", True),
    "peak-tiny": ("device.peak_flops.fp32", 1e-300),
    "peak-zero": ("device.peak_flops.fp32", 0),
    "peak-nan": ("device.peak_flops.fp32", NAN),
    "peak-inf": ("device.peak_flops.fp32", INF),
    "peak-true": ("device.peak_flops.fp32", True),
    "peak-huge": ("device.peak_flops.fp32", 1e300),
    "peak-empty": ("device.peak_flops", {}),
    "memory-true": ("device.memory_bytes", True),
    "memory-zero": ("device.memory_bytes", 0),
    "memory-bigint": ("device.memory_bytes", _Big),
    "membw-zero": ("device.memory_bandwidth_GBps", 0),
    "membw-tiny": ("device.memory_bandwidth_GBps", 1e-300),
    "devices-zero": ("node.devices_per_node", 0),
    "devices-true": ("node.devices_per_node", True),
    "devices-1e9": ("node.devices_per_node", 10**9),
    "link-bandwidth-zero": ("node.link_classes.0.bandwidth_GBps", 0),
    "link-bandwidth-tiny": ("node.link_classes.0.bandwidth_GBps", 1e-300),
    "nodes_per_switch-zero": ("network.nodes_per_switch", 0),
    "nodes_per_group-1e15": ("network.nodes_per_group", 10**15),
    "scope-bandwidth-zero": ("network.scopes.node.bandwidth_GBps", 0),
    "scope-bandwidth-nan": ("network.scopes.node.bandwidth_GBps", NAN),
    "scope-latency-negative": ("network.scopes.node.latency_us", -1),
    "scope-latency-inf": ("network.scopes.node.latency_us", INF),
    "scope-bogus": ("network.scopes.galaxy", {"bandwidth_GBps": 1, "latency_us": 1, "source": "x"}),
    "taper-zero": ("network.global_taper", 0),
    "efficiency-zero": ("efficiency.gemm", 0),
    "efficiency-two": ("efficiency.gemm", 2.0),
    "efficiency-nan": ("efficiency.attention", NAN),
    "efficiency-denormal": ("efficiency.gemm", 5e-324),
    "name-path": ("name", "../../escaped"),
    "name-dotdot": ("name", ".."),
    "fragmentation-one": ("memory.fragmentation", 1.0),
    "fragmentation-negative": ("memory.fragmentation", -0.5),
    "framework-negative": ("memory.framework_bytes", -1),
    "template-absolute": ("launch.template", "/tmp/piper-fuzz-evil.sbatch"),
    "template-dotdot": ("launch.template", "../../tests/fuzz/corpus/templates/evil.sbatch"),
    "template-number": ("launch.template", 5),
    "cpus-zero": ("launch.cpus_per_task", 0),
    "gpus-per-task-over-node": ("launch.gpus_per_task", 9),
    "backend-bogus": ("launch.backend", "mpi"),
    "max_nodes-zero": ("max_nodes", 0),
    "name-empty": ("name", ""),
    "unknown-field": ("warp_drive", True),
}

HF_BASE = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 1024,
    "tie_word_embeddings": False, "_name_or_path": "fuzz/tiny-mixtral",
}

HF_MUTATIONS = {
    "model_type-list": ("model_type", ["mixtral"]),
    "model_type-number": ("model_type", 7),
    "model_type-unknown": ("model_type", "not-a-transformer"),
    "model_type-missing": ("model_type", _DELETE),
    "tie-string-false": ("tie_word_embeddings", "false"),
    "tie-number": ("tie_word_embeddings", 0),
    "layers-true": ("num_hidden_layers", True),
    "layers-zero": ("num_hidden_layers", 0),
    "layers-string": ("num_hidden_layers", "4"),
    "layers-nan": ("num_hidden_layers", NAN),
    "layers-1e9": ("num_hidden_layers", 1_000_000_000),
    "layers-bigint": ("num_hidden_layers", _Big),
    "hidden-true": ("hidden_size", True),
    "hidden-float": ("hidden_size", 64.5),
    "hidden-missing": ("hidden_size", _DELETE),
    "heads-zero": ("num_attention_heads", 0),
    "kv-heads-three": ("num_key_value_heads", 3),
    "experts-true": ("num_local_experts", True),
    "experts-negative": ("num_local_experts", -8),
    "topk-above": ("num_experts_per_tok", 99),
    "vocab-infinity": ("vocab_size", INF),
    "intermediate-list": ("intermediate_size", [128]),
    "name-list": ("_name_or_path", ["a"]),
    "architectures-string": ("architectures", "MixtralForCausalLM"),
}


def deep(depth: int, leaf="x"):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def structural(kind: str) -> dict[str, bytes]:
    """Files that break a YAML / JSON reader before any schema is looked at."""
    yaml_files = {
        "deep-yaml-flow.yaml": ("a: " + "[" * 20000 + "]" * 20000 + "\n").encode(),
        "deep-yaml-block.yaml": "".join(f"{' ' * i}k{i}:\n" for i in range(500)).encode(),
        "duplicate-key.yaml": b"name: a\nname: b\nsource: x\n",
        "duplicate-key-nested.yaml": b"name: a\nsource: x\nattention: {num_heads: 4, num_heads: 8}\n",
        "bigint.yaml": f"name: a\nsource: x\nhidden_size: {BIG_INT}\n".encode(),
        "not-utf8.yaml": b"name: \xff\xfe caf\xe9\nsource: x\n",
        "utf16.yaml": "name: a\nsource: x\n".encode("utf-16"),
        "nul-bytes.yaml": b"name: a\x00\x00\nsource: x\n",
        "empty.yaml": b"",
        "comments-only.yaml": b"# nothing here\n",
        "top-level-list.yaml": b"- 1\n- 2\n",
        "top-level-scalar.yaml": b"42\n",
        "malformed-bracket.yaml": b"name: [a, b\nsource: x\n",
        "tab-indent.yaml": b"name: a\n\tsource: x\n",
        "python-tag.yaml": b"name: !!python/object/apply:os.system ['touch /tmp/piper-fuzz-pwned']\n",
        "billion-laughs.yaml": _laughs(),
        "yaml-nan-key.yaml": b".nan: 1\nname: a\n",
        "non-string-key.yaml": b"1: a\n2: b\n",
        "json-nan.json": b'{"name": "a", "source": "x", "hidden_size": NaN}',
        "json-infinity.json": b'{"name": "a", "source": "x", "hidden_size": Infinity}',
        "json-bigint.json": ('{"name": "a", "source": "x", "hidden_size": ' + BIG_INT + "}").encode(),
        "json-duplicate.json": b'{"name": "a", "name": "b", "source": "x"}',
        "json-deep.json": ('{"a": ' + "[" * 100000 + "]" * 100000 + "}").encode(),
        "json-truncated.json": b'{"name": "a", "sour',
        "json-bom.json": b'\xef\xbb\xbf{"name": "a"}',
        "json-big-exponent.json": b'{"name": "a", "source": "x", "hidden_size": 1e999}',
    }
    return {f"{kind}-{k}": v for k, v in yaml_files.items()}


def _laughs() -> bytes:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return ("\n".join(lines) + "\nname: x\n").encode()


NCCL_HEADER = ("#                                                              out-of-place                       in-place\n"
               "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n"
               "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)\n")


def nccl_line(size="1048576", time="45.12", alg="23.24", bus="11.62", wrong="0", in_time="44.90", in_wrong="0",
              redop="none") -> str:
    """A data line as alltoall_perf prints it (redop none: the corpus imports it as all_to_all)."""
    return f"  {size}  262144  float  {redop}  -1  {time}  {alg}  {bus}  {wrong}  {in_time}  23.35  11.68  {in_wrong}\n"


def nccl_logs() -> dict[str, bytes]:
    good = nccl_line("1024", "10.1", "0.10", "0.05") + nccl_line()
    logs = {
        "time-nan.txt": NCCL_HEADER + nccl_line(time="nan"),
        "time-inf.txt": NCCL_HEADER + nccl_line(time="inf"),
        "time-negative.txt": NCCL_HEADER + nccl_line(time="-3.0"),
        "time-zero.txt": NCCL_HEADER + nccl_line(time="0"),
        "algbw-nan.txt": NCCL_HEADER + nccl_line(alg="nan"),
        "busbw-inf.txt": NCCL_HEADER + nccl_line(bus="inf"),
        "busbw-negative.txt": NCCL_HEADER + nccl_line(bus="-1"),
        "wrong-outofplace.txt": NCCL_HEADER + nccl_line(wrong="3"),
        "wrong-inplace.txt": NCCL_HEADER + nccl_line(in_wrong="7"),
        "size-negative.txt": NCCL_HEADER + good + nccl_line(size="-1024"),
        "size-fraction.txt": NCCL_HEADER + good + nccl_line(size="1024.5"),
        "size-bigint.txt": NCCL_HEADER + nccl_line(size=BIG_INT),
        "header-no-time.txt": "#  size  count  type  redop  root  algbw  busbw  #wrong\n" + "  1024 256 float sum -1 0.1 0.2 0\n",
        "header-no-busbw.txt": "#  size  count  type  redop  root  time  algbw  #wrong\n" + "  1024 256 float sum -1 10.0 0.1 0\n",
        "data-before-header.txt": nccl_line() + NCCL_HEADER,
        "no-rows.txt": NCCL_HEADER,
        "empty.txt": "",
        "too-many-fields.txt": NCCL_HEADER + nccl_line().rstrip("\n") + " 1 2 3 4 5\n",
        "too-few-fields.txt": NCCL_HEADER + "  1024  256  float\n",
        "garbage-number.txt": NCCL_HEADER + nccl_line(time="4x5"),
        "repeated-size.txt": NCCL_HEADER + nccl_line() + nccl_line(time="50.0"),
        "time-1e308.txt": NCCL_HEADER + nccl_line(time="1e308"),
    }
    out = {k: v.encode() for k, v in logs.items()}
    out["not-utf8.txt"] = NCCL_HEADER.encode() + b"  1024 256 \xff\xfe float sum -1 10 0.1 0.1 0 10 0.1 0.1 0\n"
    return out


GOOD_STEP = {"schema_version": 1, "step": 1, "loss": 6.2, "step_time_s": 2.0, "tokens": 1024, "tokens_per_s": 512.0,
             "time_s": {"a2a": 0.2, "compute": 1.5}, "memory_bytes": [{"total_bytes": 3.0e8, "source": "x"}]}


def metrics_files() -> dict[str, bytes]:
    def rows(*changes):
        out = []
        for step, change in enumerate(changes, start=1):
            rec = dict(GOOD_STEP, step=step)
            rec.update(change)
            out.append(json.dumps(rec, allow_nan=True))
        return ("\n".join(out) + "\n").encode()

    good = {}
    files = {
        "step-time-nan.jsonl": rows(good, {"step_time_s": NAN}, {"step_time_s": NAN}),
        "step-time-inf.jsonl": rows(good, {"step_time_s": INF}, {"step_time_s": INF}),
        "step-time-1e308.jsonl": rows(good, {"step_time_s": 1e308}, {"step_time_s": 1e308}),
        "step-time-negative.jsonl": rows(good, {"step_time_s": -1.0}, {"step_time_s": -2.0}),
        "step-time-zero.jsonl": rows(good, {"step_time_s": 0}, {"step_time_s": 0}),
        "step-time-string.jsonl": rows(good, {"step_time_s": "fast"}),
        "step-time-bool.jsonl": rows(good, {"step_time_s": True}, {"step_time_s": True}),
        "loss-nan.jsonl": rows(good, {"loss": NAN}),
        "loss-inf.jsonl": rows(good, {"loss": INF}),
        "tokens-per-s-nan.jsonl": rows(good, {"tokens_per_s": NAN}, {"tokens_per_s": NAN}),
        "time-s-string.jsonl": rows(good, {"time_s": {"a2a": "lots"}}),
        "time-s-nan.jsonl": rows(good, {"time_s": {"a2a": NAN}}),
        "time-s-list.jsonl": rows(good, {"time_s": [1, 2]}),
        "memory-string-total.jsonl": rows(good, {"memory_bytes": [{"total_bytes": "big"}]}),
        "memory-nan-total.jsonl": rows(good, {"memory_bytes": [{"total_bytes": NAN}]}),
        "memory-negative.jsonl": rows(good, {"memory_bytes": [{"total_bytes": -5}]}),
        "memory-not-list.jsonl": rows(good, {"memory_bytes": {"total_bytes": 1}}),
        "memory-list-of-strings.jsonl": rows(good, {"memory_bytes": ["a", "b"]}),
        "step-missing.jsonl": rows(good, {"step": None}),
        "step-string.jsonl": rows(good, {"step": "two"}),
        "step-bool.jsonl": rows(good, {"step": True}),
        "step-negative.jsonl": rows(good, {"step": -3}),
        "schema-version-99.jsonl": rows(good, {"schema_version": 99}),
        "bigint-step.jsonl": rows(good).replace(b'"step": 1', b'"step": ' + BIG_INT.encode()),
        "duplicate-key.jsonl": rows(good).replace(b'"loss": 6.2', b'"loss": 6.2, "loss": 7.0'),
        "deep.jsonl": ('{"step": 1, "x": ' + "[" * 100000 + "]" * 100000 + "}\n").encode(),
        "truncated-line.jsonl": rows(good, good)[:-40] + b"\n",
        "not-object.jsonl": b"[1, 2, 3]\n",
        "empty.jsonl": b"",
        "not-utf8.jsonl": b'{"step": 1, "loss": "\xff\xfe"}\n',
    }
    files["step-missing.jsonl"] = rows(good).replace(b'"step": 1, ', b"")
    return files


PLAN_PATCHES = {
    # prediction values of the wrong type: launch (default --time) and compare read them
    "prediction-step-string": {"prediction.step_time_s": "abc"},
    "prediction-step-list": {"prediction.step_time_s": [1]},
    "prediction-step-dict": {"prediction.step_time_s": {"a": 1}},
    "prediction-step-bool": {"prediction.step_time_s": True},
    "prediction-step-negative": {"prediction.step_time_s": -1.0},
    "prediction-step-nan": {"prediction.step_time_s": NAN},
    "prediction-step-1e308": {"prediction.step_time_s": 1e308},
    "prediction-tokens-string": {"prediction.tokens_per_s": "many"},
    "prediction-memory-string": {"prediction.memory": "lots"},
    "prediction-per-stage-string": {"prediction.memory.per_stage": "x"},
    "prediction-per-stage-items": {"prediction.memory.per_stage": ["a", None]},
    "prediction-total-string": {"prediction.memory.per_stage.0.total_bytes": "x"},
    "prediction-components-string": {"prediction.memory.per_stage.0.components": "x"},
    "prediction-time-list": {"prediction.time": [1]},
    "prediction-breakdown-string": {"prediction.time.breakdown": "x"},
    "prediction-a2a-share-string": {"prediction.a2a_share": "x"},
    "prediction-list": {"prediction": [1, 2]},
    "prediction-per-stage-empty": {"prediction.memory.per_stage": []},        # read silently, as the plan's, before
    "prediction-layers-other": {"prediction.layers_per_stage": [1, 2, 1]},
    "prediction-scope-galaxy": {"prediction.scopes.tp": "galaxy"},
    # runtime / launch values
    "steps-1e15": {"runtime.steps": 10**15},
    "steps-zero": {"runtime.steps": 0},
    "steps-true": {"runtime.steps": True},
    "steps-bigint": {"runtime.steps": _Big},
    "template-absolute": {"platform.launch.template": "{root}/tests/fuzz/corpus/templates/evil.sbatch"},
    "template-dotdot": {"platform.launch.template": "../../tests/fuzz/corpus/templates/evil.sbatch"},
    "template-nested-dir": {"platform.launch.template": "sub/local-cpu.sbatch"},
    "template-missing": {"platform.launch.template": "no-such.sbatch"},
    "partition-newline": {"platform.launch.partition": "debug\n#SBATCH --uid=0"},
    "env-newline": {"platform.launch.env": {"X": "1\ntouch /tmp/piper-fuzz-pwned"}},
    "module-semicolon": {"platform.launch.modules": ["rocm; touch /tmp/piper-fuzz-pwned"]},
    "sbatch-newline": {"platform.launch.sbatch": ["--exclusive\ntouch /tmp/piper-fuzz-pwned"]},
    "data-dollar": {"runtime.data": "$(touch /tmp/piper-fuzz-pwned)"},
    # the plan itself
    "schema-99": {"schema_version": 99},
    "schema-string": {"schema_version": "1"},
    "nodes-zero": {"nodes": 0},
    "nodes-true": {"nodes": True},
    "nodes-1e9": {"nodes": 10**9},
    "edp-wrong": {"parallel.edp": 7},
    "dp-zero": {"parallel.dp": 0},
    "dp-true": {"parallel.dp": True},
    "layers-per-stage-huge": {"parallel.layers_per_stage": [1000000]},
    "layers-per-stage-string": {"parallel.layers_per_stage": "even"},
    "microbatches-999": {"parallel.num_microbatches": 999},
    "model-num-layers-1e9": {"model.num_layers": 1_000_000_000},
    "model-num-layers-true": {"model.num_layers": True},
    "platform-no-links": {"platform.node.link_classes": []},
    "platform-no-scopes": {"platform.network.scopes": {}},
    "training-seq-zero": {"training.seq_len": 0},
    "training-seq-nan": {"training.tokens_to_train": NAN},
    "migration-threshold-nan": {"migration.threshold": NAN},
    "moe-skew-inf": {"moe.routing_skew": INF},
    "unknown-top-field": {"surprise": 1},
    "parallel-list": {"parallel": [1]},
}

CAL_POISON = {
    # name -> (file, text or None for a directory, mode): mode 'row' appends a row to the good file, 'file' replaces it
    "gemm-nan-seconds": ("gemm.csv", "cpu,fp32,64,64,64,1,nan,1.0,measured: fuzz", "row"),
    "gemm-inf-tflops": ("gemm.csv", "cpu,fp32,64,64,65,1,0.001,inf,measured: fuzz", "row"),
    "gemm-negative-seconds": ("gemm.csv", "cpu,fp32,64,64,66,1,-1,1.0,measured: fuzz", "row"),
    "gemm-string": ("gemm.csv", "cpu,fp32,64,64,67,1,abc,1.0,measured: fuzz", "row"),
    "gemm-bigint-m": ("gemm.csv", f"cpu,fp32,{BIG_INT},64,64,1,0.1,1.0,measured: fuzz", "row"),
    "gemm-fraction-m": ("gemm.csv", "cpu,fp32,64.5,64,64,1,0.1,1.0,measured: fuzz", "row"),
    "gemm-dtype-bogus": ("gemm.csv", "cpu,fp7,64,64,64,1,0.1,1.0,measured: fuzz", "row"),
    "gemm-empty-source": ("gemm.csv", "cpu,fp32,64,64,68,1,0.1,1.0,", "row"),
    "gemm-short-row": ("gemm.csv", "cpu,fp32,64", "row"),
    "gemm-not-utf8": ("gemm.csv", None, "not-utf8"),
    "gemm-directory": ("gemm.csv", None, "directory"),
    "gemm-header-only": ("gemm.csv", "device,dtype,m,n,k,groups,seconds,tflops,source\n", "file"),
    "gemm-missing-column": ("gemm.csv", "device,dtype,m,n,k,groups,seconds,source\ncpu,fp32,1,1,1,1,1,x\n", "file"),
    "gemm-empty": ("gemm.csv", "", "file"),
    "attention-nan": ("attention.csv", "cpu,fp32,fwd,1,128,4,4,16,true,nan,1.0,measured: fuzz", "row"),
    "attention-causal-bogus": ("attention.csv", "cpu,fp32,fwd,1,128,4,4,16,maybe,0.1,1.0,measured: fuzz", "row"),
    "collectives-nan-seconds": ("collectives.csv", "all_to_all,node,1,2,3,nan,1.0,1.0,measured: fuzz", "row"),
    "collectives-inf-busbw": ("collectives.csv", "all_to_all,node,1,2,5,0.1,1.0,inf,measured: fuzz", "row"),
    "collectives-node-scope-4-nodes": ("collectives.csv", "all_to_all,node,4,2,1048576,0.1,1.0,1.0,measured: fuzz", "row"),
    "collectives-op-bogus": ("collectives.csv", "broadcast,node,1,2,7,0.1,1.0,1.0,measured: fuzz", "row"),
    "collectives-duplicate": ("collectives.csv", None, "duplicate"),
    "metadata-malformed": ("metadata.json", "{not json", "file"),
    "metadata-list": ("metadata.json", "[1, 2]", "file"),
    "metadata-nan": ("metadata.json", '{"device": {"memory_bytes_per_rank": NaN}}', "file"),
    "metadata-directory": ("metadata.json", None, "directory"),
    "overhead-nan": ("overhead.csv", None, "overhead-nan"),
    "fit-nan": ("fit.csv", "parameter,value,before,mape_before_pct,mape_after_pct,source\na2a_overlap,nan,0,1,1,x\n", "file"),
    "fit-bogus-parameter": ("fit.csv", "parameter,value,before,mape_before_pct,mape_after_pct,source\nwarp,0.5,0,1,1,x\n", "file"),
    "fit-malformed": ("fit.csv", "parameter\n\xff\n", "file"),
    "gemm-denormal-tflops": ("gemm.csv", "cpu,fp32,64,64,69,1,0.1,5e-324,measured: fuzz", "row"),
    "overhead-denormal": ("overhead.csv", "moe_block,7,5e-324,measured: fuzz", "row"),
    "gemm-stray-cr": ("gemm.csv", "cpu,fp32,64,64,70,1,0.1,1.0,measured: x\ry", "row"),
    "gemm-huge-field": ("gemm.csv", None, "huge-field"),
    "gemm-too-many-rows": ("gemm.csv", None, "many-rows"),
}

VALIDATION_FILES = {
    "deep.yaml": ("a: " + "[" * 20000 + "]" * 20000 + "\n").encode(),
    "not-utf8.yaml": b"name: \xff\n",
    "list.yaml": b"- 1\n",
    "garbage.yaml": b"name: x\nrows: 5\n",
    "empty.yaml": b"",
    "bigint.yaml": f"name: x\nrows: [{BIG_INT}]\n".encode(),
    "duplicate.yaml": b"name: x\nname: y\n",
}

TEMPLATES = {"evil.sbatch": b"#!/bin/bash\ntouch /tmp/piper-fuzz-pwned\n"}


def write(folder: str, name: str, content: bytes | str) -> None:
    path = CORPUS / folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


def main() -> None:
    sys.set_int_max_str_digits(0)
    if CORPUS.exists():
        shutil.rmtree(CORPUS)
    model = _load(ROOT / "models" / "tiny-moe.yaml")
    platform = _load(ROOT / "platforms" / "local-cpu.yaml")
    for name, (field, value) in MODEL_MUTATIONS.items():
        write("models", f"{name}.yaml", _dump_yaml(_set(model, field, _value(value))))
    write("models", "dense-no-ffn.yaml", _dump_yaml({k: v for k, v in model.items() if k != "moe"}))
    for name, content in structural("model").items():
        write("models", name, content)
    for name, (field, value) in PLATFORM_MUTATIONS.items():
        write("platforms", f"{name}.yaml", _dump_yaml(_set(platform, field, _value(value))))
    write("platforms", "memory-one-byte.yaml", _dump_yaml(_set(platform, "device.memory_bytes", 1)))
    for name, content in structural("platform").items():
        write("platforms", name, content)
    for name, (field, value) in HF_MUTATIONS.items():
        write("hf", f"{name}.json", _dump_json(_set(HF_BASE, field, _value(value))))
    for name, content in structural("hf").items():
        if name.endswith(".json"):
            write("hf", name, content)
    for name, content in nccl_logs().items():
        write("nccl", name, content)
    for name, content in metrics_files().items():
        write("metrics", name, content)
    for name, patch in PLAN_PATCHES.items():
        write("plans", f"{name}.json", _dump_json({k: _value(v) for k, v in patch.items()}))
    write("calibration", "poison.json", json.dumps(
        {k: {"file": f, "text": t, "mode": m} for k, (f, t, m) in CAL_POISON.items()}, indent=1))
    for name, content in VALIDATION_FILES.items():
        write("validation", name, content)
    for name, content in TEMPLATES.items():
        write("templates", name, content)
    total = sum(1 for p in CORPUS.rglob("*") if p.is_file())
    print(f"wrote {total} files under {CORPUS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
