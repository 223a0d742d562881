"""A CPU-heavy image pipeline offloaded to rpc-reading-worker processes.

    python examples/image_augmentation.py                  # 1, 2 and 4 local workers
    python examples/image_augmentation.py --quick          # a small run (seconds; used by the tests)
    python examples/image_augmentation.py --workers 8 --addresses cpu1:29600,cpu2:29600 --auth-key-file key

Each item is a JPEG (synthetic, made with Pillow on the workers, so nothing is downloaded)
that the workers decode, randomly crop and resize, maybe flip, and normalise to a float
tensor; batches of 32 are collated on the workers and travel to the trainer as tensors.
The trainer fakes a GPU step by sleeping a fixed time per batch. For each worker count
the script prints the throughput and the *data stall*: the share of the trainer's time
spent waiting for the next batch. A high stall means more workers would help; near zero,
the (fake) GPU is the bottleneck and more workers would not.
"""

import argparse
import functools
import io
import random
import sys
import time
import warnings

warnings.filterwarnings("ignore", message=r"(?s).*'datapipes', 'dataloader2' modules are deprecated")
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
from PIL import Image, ImageDraw, ImageFilter  # noqa: E402
from torchdata.dataloader2 import DataLoader2  # noqa: E402
from torchdata.datapipes.iter import IterDataPipe  # noqa: E402

from rpc_reading_service import RPCReadingService  # noqa: E402

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def synthetic_jpeg(seed, size):
    """A photo-like JPEG (gradient, shapes, noise, blur) made with Pillow: no download."""
    rng = random.Random(seed)
    base = Image.linear_gradient("L").resize((size, size)).rotate(rng.uniform(0, 360))
    offsets = [rng.randint(0, 255) for _ in range(3)]
    bands = [base.point(lambda v, k=k: (v * (k + 1) + offsets[k]) % 256) for k in range(3)]
    image = Image.merge("RGB", bands)
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = rng.randrange(size), rng.randrange(size)
        x1, y1 = x0 + rng.randrange(8, size // 2), y0 + rng.randrange(8, size // 2)
        fill = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=fill)
    noise = Image.effect_noise((size, size), 40).convert("RGB")
    image = Image.blend(image, noise, 0.25).filter(ImageFilter.GaussianBlur(1))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


class SyntheticJPEGs(IterDataPipe):
    """``(jpeg_bytes, label)`` for ``count`` images cycling over a pool of distinct JPEGs.

    The pool is made lazily, on first iteration, in whichever process iterates (the
    workers), and then reused, so the cost measured is decoding, not generating.
    """

    _pools = {}  # per process: (size, pool size) -> JPEG bytes; never pickled with the graph

    def __init__(self, count, size, pool=32):
        self.count, self.size, self.pool_size = count, size, pool

    def __iter__(self):
        key = (self.size, self.pool_size)
        if key not in self._pools:
            self._pools[key] = [synthetic_jpeg(seed, self.size) for seed in range(self.pool_size)]
        pool = self._pools[key]
        for index in range(self.count):
            yield pool[index % self.pool_size], index % 10

    def __len__(self):
        return self.count


def decode(sample):
    data, label = sample
    return Image.open(io.BytesIO(data)).convert("RGB"), label


def random_resized_crop_and_flip(sample, out_size):
    """torchvision's RandomResizedCrop(scale=(0.35, 1)) + RandomHorizontalFlip, in Pillow."""
    image, label = sample
    width, height = image.size
    for _ in range(10):
        area = width * height * random.uniform(0.35, 1.0)
        aspect = random.uniform(3 / 4, 4 / 3)
        w, h = int(round((area * aspect) ** 0.5)), int(round((area / aspect) ** 0.5))
        if 0 < w <= width and 0 < h <= height:
            break
    else:
        w, h = width, height
    left, top = random.randint(0, width - w), random.randint(0, height - h)
    image = image.resize((out_size, out_size), Image.BILINEAR, box=(left, top, left + w, top + h))
    if random.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    return image, label


def to_normalized_tensor(sample):
    image, label = sample
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    tensor = pixels.view(image.size[1], image.size[0], 3).permute(2, 0, 1).float().div_(255)
    return (tensor - MEAN) / STD, label


def build_pipeline(images, size, crop, batch_size):
    return (
        SyntheticJPEGs(images, size)
        .sharding_filter()
        .map(decode)
        .map(functools.partial(random_resized_crop_and_flip, out_size=crop))
        .map(to_normalized_tensor)
        .batch(batch_size)
        .collate()
    )


def run(args, num_workers, progress):
    """One epoch with ``num_workers`` workers; returns (images/s, data stall, seconds)."""
    options = dict(num_workers=num_workers)
    if args.addresses:
        key = open(args.auth_key_file).read().strip() if args.auth_key_file else None
        options.update(workers=args.addresses.split(","), auth_key=key)
    pipeline = build_pipeline(args.images, args.size, args.crop, args.batch_size)
    dl = DataLoader2(pipeline, reading_service=RPCReadingService(**options))
    dl.seed(0)
    try:
        images = waited = 0.0
        bar = None
        if progress is not None:
            bar = progress(total=args.images, desc=f"{num_workers} workers", unit="img", leave=False)
        iterator = iter(dl)  # starts the workers and ships the graph: not part of the epoch's time
        start = time.perf_counter()
        while True:
            before = time.perf_counter()
            try:
                batch, labels = next(iterator)
            except StopIteration:
                break
            waited += time.perf_counter() - before
            assert batch.shape[1:] == (3, args.crop, args.crop) and batch.dtype == torch.float32
            images += len(labels)
            time.sleep(args.step_ms / 1000)  # the fake GPU step
            if bar is not None:
                bar.update(len(labels))
        elapsed = time.perf_counter() - start
        if bar is not None:
            bar.close()
        stall = waited / elapsed
        stats = getattr(dl.reading_service, "stats", None)
        if callable(stats):  # the reading service's own figure: time blocked on the workers
            stall = stats().data_stall
        assert images == args.images, f"got {images} images, expected {args.images}"
        return images / elapsed, stall, elapsed
    finally:
        dl.shutdown()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4", help="comma-separated worker counts to compare (default 1,2,4)")
    parser.add_argument("--images", type=int, default=2048, help="images per epoch (default 2048)")
    parser.add_argument("--size", type=int, default=320, help="side of the synthetic JPEGs (default 320)")
    parser.add_argument("--crop", type=int, default=224, help="side of the crops (default 224)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=40.0, help="fake GPU time per batch (default 40 ms)")
    parser.add_argument("--addresses", help="use these rpc-reading-worker servers (host:port,...), not local ones")
    parser.add_argument("--auth-key-file", help="their key (with --addresses)")
    parser.add_argument("--progress", action="store_true", help="show a tqdm progress bar (pip install tqdm)")
    parser.add_argument("--quick", action="store_true", help="a small, fast run (for tests)")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.size, args.crop, args.step_ms = 128, 128, 96, 5.0

    progress = None
    if args.progress:
        try:
            from tqdm import tqdm as progress
        except ImportError:
            print("tqdm is not installed (pip install tqdm): no progress bar", file=sys.stderr)

    counts = [int(n) for n in args.workers.split(",")]
    print(
        f"{args.images} synthetic {args.size}x{args.size} JPEGs per epoch -> decode, random crop {args.crop} "
        f"+ flip, normalise, batches of {args.batch_size}; fake GPU step {args.step_ms:g} ms per batch"
    )
    print(f"{'workers':>7}  {'images/s':>9}  {'data stall':>10}  {'epoch':>7}")
    results = {}
    for count in counts:
        rate, stall, elapsed = run(args, count, progress)
        results[count] = (rate, stall)
        print(f"{count:>7}  {rate:>9.0f}  {stall:>10.0%}  {elapsed:>6.2f}s", flush=True)
    best = min(results, key=lambda n: results[n][1])
    print(
        f"lowest data stall with {best} workers ({results[best][1]:.0%}). Stall near 0: the GPU step is the "
        "bottleneck and more workers would not help; high: add workers (this host has "
        f"{torch.get_num_threads()} cores for torch; remote workers add more)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
