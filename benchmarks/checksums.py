"""Checksum speed for checkpoint manifests: xxh3-128 (fivefold's choice) beside hashlib's SHA-256 and others.

A manifest hashes every byte of every checkpoint file at save and again at load, on every rank,
so the hash's speed is a direct cost of verified checkpoints. The candidates the issue named:
SHA-256 (hashlib, the cryptographic baseline and the peer here), xxHash (xxh3-64 and xxh3-128, the
`xxhash` package) and CRC-32 (zlib; crc32c needs another package), plus hashlib's blake2b.
Against accidental damage any 64/128-bit hash catches a flipped bit; against an attacker none does
in an unsigned manifest (docs/reliability.md), so the fastest well-kept 128-bit hash wins.

Timed in memory (the hash alone) and from a file (read + hash, the page cache warm, as right after
a save), median of --rounds. Prints a table and `RESULT name=checksums ...`; --json for machines.

    python benchmarks/checksums.py --mib 256 --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import xxhash


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)


HASHES = {
    "xxh3_128": xxhash.xxh3_128,
    "xxh3_64": xxhash.xxh3_64,
    "crc32": _Crc32,
    "blake2b": hashlib.blake2b,
    "sha256": hashlib.sha256,
}


def hash_buffer(make, buffer: memoryview, chunk: int = 8 << 20) -> None:
    hasher = make()
    for start in range(0, len(buffer), chunk):
        hasher.update(buffer[start:start + chunk])


def hash_path(make, path: Path, chunk: int = 8 << 20) -> None:
    hasher = make()
    with open(path, "rb") as handle:
        while data := handle.read(chunk):
            hasher.update(data)


def median_gbps(fn, nbytes: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes hashed per round, in MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    nbytes = args.mib << 20
    buffer = memoryview(os.urandom(nbytes))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.distcp"
        path.write_bytes(buffer)
        for name, make in HASHES.items():
            results[name] = {"memory_gbps": median_gbps(lambda: hash_buffer(make, buffer), nbytes, args.rounds),
                             "file_gbps": median_gbps(lambda: hash_path(make, path), nbytes, args.rounds)}
    peer = results["sha256"]
    print(f"{'hash':<10} {'memory GB/s':>12} {'file GB/s':>10} {'vs sha256':>10}   ({args.mib} MiB, median of {args.rounds})")
    for name, r in results.items():
        print(f"{name:<10} {r['memory_gbps']:>12.2f} {r['file_gbps']:>10.2f} {r['memory_gbps'] / peer['memory_gbps']:>9.1f}x")
    fields = {f"{name}_gbps": round(r["memory_gbps"], 3) for name, r in results.items()}
    fields.update({f"file_{name}_gbps": round(r["file_gbps"], 3) for name, r in results.items()})
    fields["xxh3_128_vs_sha256"] = round(results["xxh3_128"]["memory_gbps"] / peer["memory_gbps"], 2)
    fields["file_xxh3_128_vs_sha256"] = round(results["xxh3_128"]["file_gbps"] / peer["file_gbps"], 2)
    print("RESULT name=checksums " + " ".join(f"{k}={v}" for k, v in fields.items()))
    if args.json:
        print(json.dumps({"mib": args.mib, "rounds": args.rounds, "results": results}))


if __name__ == "__main__":
    main()
