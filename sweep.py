#!/usr/bin/env python
"""sweep: placeholder entry point until its issue lands; --help works."""
import argparse

if __name__ == "__main__":
    argparse.ArgumentParser(description="sweep (not implemented yet)").parse_args()
