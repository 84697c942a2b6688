#!/usr/bin/env python
"""merge_and_infer: placeholder entry point until its issue lands; --help works."""
import argparse

if __name__ == "__main__":
    argparse.ArgumentParser(description="merge_and_infer (not implemented yet)").parse_args()
