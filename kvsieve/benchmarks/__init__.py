"""Benchmarks: speed and memory of the evicting caches against transformers' ``DynamicCache`` and the floor."""

from kvsieve.benchmarks.bench import Cell, benchmark, evaluate_targets, profile_decode, run_bench
from kvsieve.benchmarks.floor import FloorCache, FloorLayer

__all__ = ["Cell", "FloorCache", "FloorLayer", "benchmark", "evaluate_targets", "profile_decode", "run_bench"]
