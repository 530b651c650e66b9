"""Stream a completion from splitserve's gRPC API (splitserve.v1.Frontend/Generate).

The client code comes from protos/splitserve.proto.  In this repository the
setup generates it (`python -m protos.codegen`); in a project of your own:

    python -m grpc_tools.protoc -I path/to/splitserve --python_out=. --grpc_python_out=. \\
        path/to/splitserve/protos/splitserve.proto

    python examples/grpc_client.py --address localhost:50051 "The capital of France is"

With API keys configured, pass one with --api-key or SPLITSERVE_API_KEY.
"""

from __future__ import annotations

import sys

import grpc
from example_args import example_parser

from protos import pb, pb_grpc


def main() -> int:
    p = example_parser(__doc__, grpc=True)
    p.add_argument("prompt", help="the text to complete")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    args = p.parse_args()

    request = pb.GenerateRequest(
        model=args.model, text=args.prompt,
        sampling=pb.SamplingParams(temperature=0, max_tokens=args.max_tokens))
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    finish = ""
    with grpc.insecure_channel(args.address) as channel:
        for chunk in pb_grpc.FrontendStub(channel).Generate(request, metadata=metadata, timeout=120):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            finish = chunk.finish_reason or finish
            if chunk.HasField("usage"):  # the stream's last message
                print(f"\n[{finish}: {chunk.usage.prompt_tokens} prompt tokens, "
                      f"{chunk.usage.completion_tokens} generated]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
