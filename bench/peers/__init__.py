"""Benchmark peers: one module per system, each with its server entry point and client."""

from __future__ import annotations
