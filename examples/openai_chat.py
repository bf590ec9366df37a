"""Chat completions through chatmesh with the official OpenAI SDK, unmodified, streamed.

    .venv/bin/python examples/openai_chat.py --token "$(make -s token)" "What is the capital of France?"

The token is the user's JWT, passed as the API key; the base URL is Envoy's. Which parameters chatmesh
supports, refuses or ignores: docs/api/openai.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import openai


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("message", help="what to ask")
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1", help="Envoy's /v1")
    parser.add_argument("--token", default=os.environ.get("TOKEN"), help="a JWT (default: $TOKEN)")
    parser.add_argument("--max-tokens", type=int, default=None, help="longest answer")
    args = parser.parse_args(argv)
    if not args.token:
        parser.error("no token: pass --token or set TOKEN (make token USER=alice TIER=pro prints one)")

    # The SDK retries 429 and 503 by itself, after the Retry-After chatmesh sends.
    client = openai.OpenAI(base_url=args.base_url, api_key=args.token, max_retries=3)
    try:
        stream = client.chat.completions.create(
            model="",  # the server's default model
            messages=[{"role": "user", "content": args.message}],
            max_completion_tokens=args.max_tokens,
            temperature=0,
            seed=7,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
            if chunk.choices and chunk.choices[0].finish_reason:
                print(f"\n[finish_reason: {chunk.choices[0].finish_reason}]")
            if chunk.usage:
                print(
                    f"[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]"
                )
    except openai.APIStatusError as error:
        print(f"{error.status_code}: {error.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
