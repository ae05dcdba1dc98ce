"""The same formula model behind LitServe, the peer a user might pick instead of Texel.

    python -m bench.litserve_formula --model models/formula/default --port 8100 \
        --max-batch-size 64 --batch-timeout 0.01 --api-servers 1

It uses Texel's own adapter for preprocessing, batching and decoding, so the
comparison measures the serving layer, not the model code. Requests are JSON
`{"image_base64": ...}` on `/predict`, answered `{"latex": ...}`.
"""

from __future__ import annotations

import argparse
import base64

import litserve as ls
import torch

from models.devices import resolve_devices
from models.formula.adapter import FormulaRecognizer


class FormulaAPI(ls.LitAPI):
    def __init__(self, model: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model_source = model

    def setup(self, device: str) -> None:
        self.device = torch.device(device)
        self.recognizer = FormulaRecognizer(self.model_source, [self.device])
        self.recognizer.open()
        self.recognizer.load(self.device)
        self.recognizer.warmup(self.device, self.max_batch_size)
        self.run = self.recognizer.runner(self.device)

    def decode_request(self, request):
        return self.recognizer.preprocess(base64.b64decode(request["image_base64"]))

    def batch(self, inputs):
        return list(inputs)

    def predict(self, batch):
        items = batch if isinstance(batch, list) else [batch]
        out = self.run(items, lambda: False)
        return out if isinstance(batch, list) else out[0]

    def unbatch(self, output):
        return list(output)

    def encode_response(self, output):
        return {"latex": self.recognizer.detokenize(output).latex}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/formula/default")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--batch-timeout", type=float, default=0.01)
    parser.add_argument(
        "--api-servers", type=int, default=1, help="LitServe's num_api_servers (HTTP processes)"
    )
    args = parser.parse_args()
    device = resolve_devices(args.device)[0]
    api = FormulaAPI(
        args.model, max_batch_size=args.max_batch_size, batch_timeout=args.batch_timeout
    )
    accelerator = "cuda" if device.type == "cuda" else "cpu"
    server = ls.LitServer(api, accelerator=accelerator, devices=1, timeout=120)
    server.run(
        port=args.port,
        host="127.0.0.1",
        generate_client_file=False,
        num_api_servers=args.api_servers,
    )


if __name__ == "__main__":
    main()
