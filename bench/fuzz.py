"""The differential fuzzer's big runs, from bench/ (the same command as
`python -m tests.fuzz.run`; tests/fuzz/README.md): generated programs compiled and compared
with eager on every call; prints counts and appends a record to bench/records/fuzz.jsonl.

    python3 bench/fuzz.py --programs 10000 --backend eager
    python3 bench/fuzz.py --programs 2000 --backend mixed --weld-share 0.2
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fuzz.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
