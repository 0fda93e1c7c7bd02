"""Benchmarks behind `tlt bench ...`: each prints a table (or JSON) of figures it measured itself."""
