"""Turning run records into comparisons: load_runs, tables, figures, reports."""

from analysis.runs import load_metrics, load_runs

__all__ = ["load_metrics", "load_runs"]
