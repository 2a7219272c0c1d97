"""kvlocal's Python API, as a desktop assistant would use it: read a long document into a bounded
cache, ask about it, save the compressed session, and continue it later in another process.

    .venv/bin/python examples/chat_api.py [DOCUMENT] [--model smollm2-135m] [--budget 0.1]

Run it twice: the first run reads the document and saves `DOCUMENT-NAME.kvl` in the current folder; the second loads
the saved session (no re-reading) and asks a follow-up question.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import kvlocal
from kvlocal.errors import UsageError


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("document", nargs="?", default=str(Path(kvlocal.__file__).parent / "data" / "gpl-3.0.txt"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budget", default="0.1")
    args = ap.parse_args()
    saved = Path(Path(args.document).stem + ".kvl")  # in the current folder
    try:
        if saved.exists():
            chat = kvlocal.Chat.load(saved)  # the same model file is found from the session
            question = "And what does it say about patents?"
            print(f"loaded {saved}: {chat.stats.tokens_seen:,} tokens seen, {chat.stats.kv_tokens_kept:,} kept")
        else:
            chat = kvlocal.Chat(args.model, budget=args.budget)
            n = chat.read(args.document, progress=lambda done, total: print(f"\rreading {done:,}/{total:,}", end="", file=sys.stderr))
            print(f"\nread {n:,} tokens")
            question = "What is this document about?"
        with chat:
            print(f"> {question}")
            for piece in chat.send(question, max_tokens=80):
                print(piece, end="", flush=True)
            print()
            print(chat.status_line())
            chat.save(saved)
            print(f"saved {saved}")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
