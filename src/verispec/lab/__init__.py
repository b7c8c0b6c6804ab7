"""The lab: honest benchmarks, sweeps, audits, reports and the demo.

Every measurement is one JSONL record per run (`records`); tables and plots are
derived from those records alone (`report`), and every speculative run is
audited against the target alone and against physics (`audit`).
"""
