#!/usr/bin/env python
"""train_pretrain: placeholder entry point until its issue lands; --help works."""
import argparse

if __name__ == "__main__":
    argparse.ArgumentParser(description="train_pretrain (not implemented yet)").parse_args()
