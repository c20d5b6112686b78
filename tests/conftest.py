import os
import sys

# The Triton interpreter must be chosen before any kernel module imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
