"""Schedules built on the fusion primitives."""
