"""Companion labs: each `labNN_topic.py` is a torchrun entry point (`./run.sh NN`) and a module the
notebooks and tests import."""
