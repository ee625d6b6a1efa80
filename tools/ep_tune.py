#!/usr/bin/env python3
"""Measure the EP kernels' launch geometry and write MORI_EP_LAUNCH_CONFIG_MODE=AUTO tables.

For every shape engines run (hidden 4096 / 5120 / 7168, top-k 6 / 8 / 9, 64 to 4096 tokens per
rank, bf16 and fp8 dispatch, ordinary and zero-copy combine) it times candidates of ``block_num``
(``--sms``), ``warp_per_block`` and the tile (``tile_elems``) with ``mori bench ep`` on the GPUs of
this machine, and keeps the fastest per shape: the median latency of the slowest rank, which at
a fixed shape ranks candidates the same way as the bandwidth. Tables go to
``mori/ep/tuning_configs/{arch}_{model}_IntraNode_ep{ranks}_{dispatch|combine}.json`` (the format
:mod:`mori.ep.tuning` reads); a rule already there is replaced only by a faster one unless
``--replace`` (keep-best merge, so partial sweeps add up).

How a candidate is timed: ``mori bench ep`` runs once per (hidden, top-k, warps, tile, zero-copy)
with every token count and SM budget of the sweep at once (``--tokens``, ``--sms``); the warps and
the tile reach the kernels through a one-rule table given as ``MORI_EP_TUNING_CONFIG`` with
``MORI_EP_LAUNCH_CONFIG_MODE=AUTO`` (the bench passes ``--warps -1``), ``--sms`` sets block_num.

    python tools/ep_tune.py --ranks 2 --scope quick --dry-run     # the plan: runs and their commands
    python tools/ep_tune.py --ranks 2 --scope quick               # ~20 runs: warps 16, default tiles
    python tools/ep_tune.py --ranks 2 --scope full                # warps 8/16/32 x 3 tiles: ~160 runs
    python tools/ep_tune.py --ranks 2 --from-json bench-results/tune/*.json   # tables from records

One GPU shared by the ranks (MPS) measures another machine than one GPU per rank: the tables
are named by the GPU model and EP size only, so tune with the layout you serve with.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TABLES = ROOT / "packages" / "mori-ep" / "src" / "mori" / "ep" / "tuning_configs"
KERNEL = "IntraNode"
DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}
#: the shapes engines run (issue 16)
HIDDEN = (4096, 5120, 7168)
TOPK = (6, 8, 9)
TOKENS = (64, 128, 256, 512, 1024, 2048, 4096)
SCOPES = {
    # (warps, dispatch tiles, combine tiles)
    "quick": ((16,), (16384,), (32768,)),
    "full": ((8, 16, 32), (8192, 16384, 32768), (8192, 16384, 32768)),
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def candidate_table(
    warps: int, tile_d: int, tile_c: int, hidden: int, topk: int, zero_copy: bool
) -> dict[str, Any]:
    """One rule per phase and dtype covering every token count (num_tokens ceiling 1 << 30)."""
    rules: list[dict[str, Any]] = []
    for dtype in DTYPES.values():
        base = {"dtype": dtype, "num_tokens": 1 << 30, "hidden_dim": hidden, "topk": topk, "block_num": 1}
        rules.append({**base, "phase": "dispatch", "warp_per_block": warps, "tile_elems": tile_d})
    rules.append(
        {
            "dtype": "bfloat16",
            "zero_copy": zero_copy,
            "num_tokens": 1 << 30,
            "hidden_dim": hidden,
            "topk": topk,
            "block_num": 1,
            "warp_per_block": warps,
            "tile_elems": tile_c,
            "phase": "combine",
        }
    )
    return {"about": "ep_tune.py candidate", "rules": rules}


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    warps_l, tiles_d, tiles_c = SCOPES[args.scope]
    runs = []
    for hidden, topk, warps, (tile_d, tile_c), zero_copy in itertools.product(
        args.hidden, args.topk, warps_l, zip(tiles_d, tiles_c, strict=True), (False, True)
    ):
        runs.append(
            {
                "hidden": hidden,
                "topk": topk,
                "warps": warps,
                "tile_d": tile_d,
                "tile_c": tile_c,
                "zero_copy": zero_copy,
            }
        )
    return runs


def bench_command(args: argparse.Namespace, run: dict[str, Any], json_path: Path) -> list[str]:
    mori = shutil.which("mori") or "mori"
    cmd = [mori, "bench", "ep", "--device", "cuda", "--ranks", str(args.ranks)]
    cmd += [
        "--tokens",
        ",".join(map(str, args.tokens)),
        "--hidden",
        str(run["hidden"]),
        "--topk",
        str(run["topk"]),
    ]
    cmd += [
        "--experts",
        str(args.experts),
        "--dtype",
        ",".join(args.dtype),
        "--sms",
        ",".join(map(str, args.sms)),
    ]
    cmd += [
        "--warps",
        "-1",
        "--iters",
        str(args.iters),
        "--no-baseline",
        "--json",
        str(json_path),
        "--plot",
        "none",
    ]
    if run["zero_copy"]:
        cmd.append("--zero-copy")
    return cmd


def measure(args: argparse.Namespace) -> list[Path]:
    runs = plan(args)
    out_dir = Path(args.records)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{len(runs)} runs of mori bench ep ({args.scope} scope); records in {out_dir}")
    paths = []
    for i, run in enumerate(runs):
        name = "h{hidden}_k{topk}_w{warps}_t{tile_d}-{tile_c}_zc{zc}".format(**run, zc=int(run["zero_copy"]))
        json_path = out_dir / f"{name}.json"
        cmd = bench_command(args, run, json_path)
        print(f"[{i + 1}/{len(runs)}] {' '.join(cmd)}", flush=True)
        if args.dry_run:
            continue
        if json_path.exists() and not args.again:
            print("  (record exists: kept; --again to remeasure)")
            paths.append(json_path)
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(
                candidate_table(
                    run["warps"], run["tile_d"], run["tile_c"], run["hidden"], run["topk"], run["zero_copy"]
                ),
                f,
            )
            table = f.name
        env = {**os.environ, "MORI_EP_LAUNCH_CONFIG_MODE": "AUTO", "MORI_EP_TUNING_CONFIG": table}
        t0 = time.monotonic()
        res = subprocess.run(cmd, env=env, check=False)
        os.unlink(table)
        print(f"  exit {res.returncode} in {time.monotonic() - t0:.0f} s", flush=True)
        if res.returncode == 0:
            _annotate(json_path, run)
            paths.append(json_path)
    return paths


def _annotate(path: Path, run: dict[str, Any]) -> None:
    """Record the candidate's warps and tiles in the bench record (the bench saw -1)."""
    rec = json.loads(path.read_text())
    rec["tune"] = run
    path.write_text(json.dumps(rec, indent=2) + "\n")


def best_rules(records: list[dict[str, Any]]) -> dict[str, dict[tuple[Any, ...], dict[str, Any]]]:
    """From bench records (with their ``tune`` candidate): per phase, the fastest verified rule for
    each (dtype, zero_copy, num_tokens, hidden_dim, topk)."""
    best: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {"dispatch": {}, "combine": {}}
    for rec in records:
        tune = rec["tune"]
        for row in rec["rows"]:
            if not row.get("verified", False):
                continue
            phase = row["phase"]
            dtype = DTYPES[row["dispatch_dtype"]]
            zc = bool(tune["zero_copy"]) if phase == "combine" else False
            rule: dict[str, Any] = {"dtype": dtype}
            if phase == "combine":
                rule["zero_copy"] = zc
                rule["dtype"] = "bfloat16" if row["dispatch_dtype"] == "bf16" else dtype
            rule.update(
                num_tokens=row["tokens"],
                hidden_dim=tune["hidden"],
                topk=tune["topk"],
                block_num=row["sms"],
                warp_per_block=tune["warps"],
                tile_elems=tune["tile_d"] if phase == "dispatch" else tune["tile_c"],
                latency_us=round(row["latency_us"]["median"], 2),
                bandwidth_gbps=round(row["gbps_original"], 1),
            )
            key = (rule["dtype"], zc, rule["num_tokens"], rule["hidden_dim"], rule["topk"])
            if phase == "combine" and row["dispatch_dtype"] != "bf16":
                continue  # (combine is bf16 in both dtype runs: keep the bf16 run's)
            old = best[phase].get(key)
            if old is None or rule["latency_us"] < old["latency_us"]:
                best[phase][key] = rule
    return best


def merge(path: Path, new: dict[tuple[Any, ...], dict[str, Any]], about: str, replace: bool) -> int:
    """Keep-best merge of ``new`` rules into the table at ``path``; returns rules written."""

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (
            r["dtype"],
            bool(r.get("zero_copy", False)),
            r["num_tokens"],
            r.get("hidden_dim"),
            r.get("topk"),
        )

    old = json.loads(path.read_text())["rules"] if path.exists() and not replace else []
    table = {key(r): r for r in old}
    for k, r in new.items():
        have = table.get(k)
        if have is None or "latency_us" not in have or r["latency_us"] < have["latency_us"]:
            table[k] = r
    rules = sorted(
        table.values(),
        key=lambda r: (
            r["dtype"],
            bool(r.get("zero_copy")),
            r.get("hidden_dim") or 0,
            r.get("topk") or 0,
            r["num_tokens"],
        ),
    )
    path.write_text(json.dumps({"about": about, "rules": rules}, indent=2) + "\n")
    return len(rules)


def write_tables(args: argparse.Namespace, paths: list[Path]) -> None:
    records = [json.loads(p.read_text()) for p in paths]
    records = [r for r in records if "tune" in r]
    if not records:
        sys.exit("no tuning records (bench records annotated by this script) to build tables from")
    name = records[0]["config"].get("device_name", "unknown GPU")
    arch, model = args.arch, args.model
    if not arch or not model:
        import torch

        props = torch.cuda.get_device_properties(0)
        arch = arch or getattr(props, "gcnArchName", "").split(":")[0] or f"sm{props.major}{props.minor}"
        model = model or props.name.split()[-1]
    best = best_rules(records)
    about = (
        f"EP{args.ranks} {KERNEL} on {name} ({arch}), measured by tools/ep_tune.py --scope {args.scope} "
        f"(mori bench ep --device cuda --ranks {args.ranks} --iters {args.iters}, git {records[0].get('git_sha', '?')}, "
        f"{records[0].get('time_utc', '?')}); fastest median latency of the slowest rank per shape"
    )
    out = Path(args.out)
    for phase, rules in best.items():
        path = out / f"{arch}_{model}_{KERNEL}_ep{args.ranks}_{phase}.json"
        n = merge(path, rules, about, args.replace)
        print(f"wrote {path} ({n} rules)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--ranks", type=int, default=2, help="EP ranks (one table per EP size)")
    p.add_argument("--scope", choices=sorted(SCOPES), default=os.environ.get("MORI_TUNING_SCOPE", "quick"))
    p.add_argument("--hidden", type=_ints, default=list(HIDDEN))
    p.add_argument("--topk", type=_ints, default=list(TOPK))
    p.add_argument("--tokens", type=_ints, default=list(TOKENS))
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--dtype", type=lambda t: t.split(","), default=list(DTYPES))
    p.add_argument("--sms", type=_ints, default=[16, 32, 64, 96, 132], help="block_num candidates")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--records", default="bench-results/tune", help="where the bench records go")
    p.add_argument("--out", default=str(TABLES), help="where the tables go")
    p.add_argument("--arch", default="", help="table name's arch (default: GPU 0's, e.g. sm90)")
    p.add_argument("--model", default="", help="table name's model (default: GPU 0's, e.g. H200)")
    p.add_argument("--replace", action="store_true", help="replace the tables instead of keep-best merging")
    p.add_argument("--again", action="store_true", help="remeasure runs whose record exists")
    p.add_argument("--dry-run", action="store_true", help="print the plan only")
    p.add_argument("--from-json", nargs="*", default=None, help="build tables from these records only")
    args = p.parse_args(argv)
    if args.from_json is not None:
        write_tables(args, [Path(x) for x in args.from_json])
        return 0
    paths = measure(args)
    if not args.dry_run:
        write_tables(args, paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
