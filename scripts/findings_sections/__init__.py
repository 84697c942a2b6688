"""The findings generator's sections, one module per part of docs/findings/README.md (scripts/findings.py runs them)."""
