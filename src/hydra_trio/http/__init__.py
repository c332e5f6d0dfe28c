"""HTTP API (Quart-Trio on Hypercorn)."""
