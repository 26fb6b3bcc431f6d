"""Tools to build random releases for tests, benchmarks and the demo model (never used when serving)."""
