"""Write a table of generated product photos, to try "Your own images to a search service" without photos of one's own.

``python docs/examples/product_photos.py my_images.csv`` writes ``photos/product-NNN/K.jpg`` beside the table
(a product is one of the synthetic data's objects, each photo a new view of it: :func:`shards.build.synthetic.render`)
and the table with the columns ``dmltrain shards build --layout table`` reads: ``path`` (relative to the table),
``label`` (``sku-NNN``), ``split`` (the first products ``train``, the others ``test``) and an extra ``title``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script from anywhere in the checkout
    sys.path.insert(0, str(REPO))

from shards.build.synthetic import render  # noqa: E402


def write_table(table: Path, products: int, train: int, photos: int, size: int, seed: int = 0) -> int:
    """Write the photos and ``table``; the number of rows."""
    rows = []
    for product in range(products):
        for k in range(photos):
            path = Path("photos", f"product-{product:03d}", f"{k}.jpg")
            (table.parent / path).parent.mkdir(parents=True, exist_ok=True)
            render(seed, product, k, size).save(table.parent / path, quality=90)
            split = "train" if product < train else "test"
            rows.append((path.as_posix(), f"sku-{product:03d}", split, f"product {product} photo {k}"))
    with open(table, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(("path", "label", "split", "title"))
        writer.writerows(rows)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("table", type=Path, help="the CSV to write; the photos go in photos/ beside it")
    p.add_argument("--products", type=int, default=60, help="products (classes), default 60")
    p.add_argument("--train", type=int, default=40, help="products in the train split, default 40; the rest test")
    p.add_argument("--photos", type=int, default=8, help="photos per product, default 8")
    p.add_argument("--size", type=int, default=48, help="photo side in pixels, default 48")
    args = p.parse_args(argv)
    if not 0 < args.train < args.products:
        p.error(f"--train: needs 0 < train < products ({args.products}), got {args.train}")
    rows = write_table(args.table, args.products, args.train, args.photos, args.size)
    print(f"wrote {rows} photos of {args.products} products and {args.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
