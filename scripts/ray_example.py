"""Ray Data example: answer support tickets with clef-serve engines in Ray actors, on one machine.

    pip install -c constraints-cpu.txt -e ".[ray]"
    python scripts/ray_example.py                         # 200 demo tickets, 2 actors, the demo model
    python scripts/ray_example.py --input tickets.jsonl --w /models/clef-flash --actors 4 --output answers/

Without --input it writes 200 held-out tickets of the embedded demo model's task (clefserve/demo) to a
temporary JSONL file, one /v1/systemone body per line, and prints the demo model's accuracy on them. On a
cluster, connect with ray.init(address="auto") instead and give each actor a GPU (num_gpus=1, --d 0).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import ray

from clefserve.ray import decide


def demo_tickets(folder: Path, count: int) -> tuple[Path, dict[str, dict]]:
    """Held-out demo tickets as JSONL, and each one's right answers by id."""
    from clefserve.testing.triage import generate

    path = folder / "tickets.jsonl"
    expected = {}
    with path.open("w") as f:
        for i, example in enumerate(generate(count, seed=2026, templates="heldout")):
            ticket = f"T-{i}"
            f.write(json.dumps({"id": ticket, **example.request}) + "\n")
            expected[ticket] = example.expected
    return path, expected


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--input", type=Path, help="JSONL of /v1/systemone bodies (default: demo tickets)")
    parser.add_argument("--output", type=Path, help="write the answers here as Parquet files")
    parser.add_argument("--w", dest="weights", help="release folder (default: the demo model)")
    parser.add_argument("--actors", type=int, default=2, help="actors, one engine each (default: 2)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="clef-ray-"))
    path, expected = (args.input, {}) if args.input else demo_tickets(workdir, 200)
    # Ray counts CPUs as slots: one per actor, and one for the task that reads the input.
    ray.init(num_cpus=max(os.cpu_count() or 1, args.actors + 1), include_dashboard=False)
    answers = decide(ray.data.read_text(str(path)), actors=args.actors, batch_size=25,
                     weights=args.weights, max_num_seqs=8, kv_cache_mb=256)
    if args.output:
        answers.write_parquet(str(args.output))
        print(f"answers written to {args.output}")
        return
    rows = answers.take_all()
    right = asked = 0
    for row in rows:
        if row["status"] != 200:
            print(row["id"], "error", row["error"])
            continue
        response = json.loads(row["response"])
        for question, want in expected.get(row["id"], {}).items():
            answer = response["answers"][question]
            got = {"choice": answer.get("choice"), "score": round(answer.get("score", -1)),
                   "noul": answer.get("noul", 0) >= 0.5}[answer["type"]]
            asked += 1
            right += got == (str(want) if answer["type"] == "choice" else want)
    print(f"{len(rows)} records answered by {args.actors} actors")
    for row in rows[:3]:
        print(row["id"], row["response"][:160], "...")
    if asked:
        print(f"demo model: {right}/{asked} answers right ({right / asked:.1%})")


if __name__ == "__main__":
    main()
