"""Tiny dataset trees in the official layouts, with real image files, for tests.

Each ``make_*`` writes under ``root`` and returns a :class:`Fixture` describing what it
wrote: per split the expected (original class id -> number of readable images) and the
relative paths of deliberately broken images. Images are small (32-48 px), non-square, and
coloured by class (a class's images share a hue), so a test can also tell classes apart.

* SOP: ``Ebay_train.txt`` / ``Ebay_test.txt`` with the official header; JPEGs named ``.JPG``.
* CUB: ``images.txt``, ``image_class_labels.txt``, ``images/NNN.Name/*.jpg``; classes at
  the edges of the 1-100 / 101-200 split.
* Cars: ``car_ims/*.jpg`` and ``cars_annos.mat`` written with ``scipy.io.savemat`` in the
  original struct layout (``annotations``: bbox, ``class``, ``test``, ``relative_im_path``).
* In-Shop: ``list_eval_partition.txt`` (count line, header, rows) and ``img/...`` JPEGs;
  query and gallery share items, and one gallery-only item is a distractor.
* folder: ``train/<class>/*`` and ``test/<class>/*`` mixing JPEG, grayscale PNG, RGBA PNG,
  BMP, plus a text file that is not an image; :func:`make_folder_tree` for any class names,
  :func:`make_folder_shared_class` for a tree whose train and test share a class (refused).
"""

from __future__ import annotations

import colorsys
import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image


@dataclass
class Fixture:
    root: Path
    # split -> original class id -> number of readable images
    classes: dict[str, dict[str, int]] = field(default_factory=dict)
    broken: list[str] = field(default_factory=list)  # relative paths that must be skipped

    def images(self, split: str) -> int:
        return sum(self.classes[split].values())


def class_image(class_key: int, k: int, size: tuple[int, int] = (40, 32), mode: str = "RGB") -> Image.Image:
    """A small image whose hue encodes the class and whose pattern varies with ``k``."""
    rng = np.random.default_rng([class_key, k])
    w, h = size
    rgb = np.array(colorsys.hsv_to_rgb((class_key * 0.137) % 1.0, 0.8, 0.9)) * 255
    arr = np.empty((h, w, 3), np.float32)
    arr[:] = rgb
    y0, x0 = rng.integers(0, h // 2), rng.integers(0, w // 2)
    arr[y0 : y0 + h // 3, x0 : x0 + w // 3] = 255 - rgb  # a patch that moves with k
    arr += rng.normal(0, 8, arr.shape)
    img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")
    if mode == "L":
        return img.convert("L")
    if mode == "RGBA":
        img = img.convert("RGBA")
        img.putalpha(Image.fromarray(np.full((h, w), 200, np.uint8)))
    return img


def save(img: Image.Image, path: Path, fmt: str = "JPEG") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))


def write_truncated_jpeg(path: Path, class_key: int = 0) -> None:
    """A JPEG cut in half: the header parses, the decode fails."""
    buf = io.BytesIO()
    class_image(class_key, 99, (48, 48)).save(buf, format="JPEG", quality=90)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])


def make_sop(root: Path, broken: bool = True) -> Fixture:
    """SOP: train classes 1-5, test classes 6-9 (2-4 images each); one truncated train image."""
    fx = Fixture(root)
    image_id = 0
    for split, class_ids in (("train", range(1, 6)), ("test", range(6, 10))):
        lines = ["image_id class_id super_class_id path"]
        counts = {}
        for c in class_ids:
            n = 2 + c % 3
            counts[str(c)] = n
            for k in range(n):
                image_id += 1
                rel = f"{'bicycle' if c % 2 else 'chair'}_final/{c:06d}_{k}.JPG"
                save(class_image(c, k), root / rel)
                lines.append(f"{image_id} {c} {1 + c % 2} {rel}")
        if split == "train" and broken:
            image_id += 1
            rel = "chair_final/000002_broken.JPG"
            write_truncated_jpeg(root / rel, 2)
            lines.append(f"{image_id} 2 1 {rel}")
            fx.broken.append(rel)
        (root / f"Ebay_{split}.txt").write_text("\n".join(lines) + "\n")
        fx.classes[split] = counts
    return fx


def make_cub(root: Path) -> Fixture:
    """CUB: train classes 1, 2, 100; test classes 101, 150, 200; 3 images each."""
    fx = Fixture(root)
    images, labels = [], []
    image_id = 0
    for split, class_ids in (("train", (1, 2, 100)), ("test", (101, 150, 200))):
        fx.classes[split] = {}
        for c in class_ids:
            folder = f"{c:03d}.Bird_{c}"
            for k in range(3):
                image_id += 1
                rel = f"{folder}/Bird_{c}_{k:04d}_{image_id}.jpg"
                save(class_image(c, k), root / "images" / rel)
                images.append(f"{image_id} {rel}")
                labels.append(f"{image_id} {c}")
            fx.classes[split][str(c)] = 3
    (root / "images.txt").write_text("\n".join(images) + "\n")
    (root / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    return fx


def make_cars(root: Path) -> Fixture:
    """Cars196: train classes 1, 2, 98; test classes 99, 150, 196; 2-3 images each; the official .mat struct."""
    import scipy.io

    fx = Fixture(root)
    fields = ["bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "test", "relative_im_path"]
    rows = []
    n = 0
    for split, class_ids in (("train", (1, 2, 98)), ("test", (99, 150, 196))):
        fx.classes[split] = {}
        for c in class_ids:
            count = 2 + c % 2
            for k in range(count):
                n += 1
                rel = f"car_ims/{n:06d}.jpg"
                save(class_image(c, k, (48, 32)), root / rel)
                rows.append(
                    (
                        np.array([[1]], np.uint8),
                        np.array([[2]], np.uint8),
                        np.array([[40]], np.uint8),
                        np.array([[30]], np.uint8),
                        np.array([[c]], np.uint8),
                        np.array([[k % 2]], np.uint8),
                        np.array([rel]),
                    )
                )
            fx.classes[split][str(c)] = count
    annotations = np.empty((1, len(rows)), dtype=[(f, "O") for f in fields])
    for i, row in enumerate(rows):
        annotations[0, i] = row
    class_names = np.empty((1, 196), dtype="O")
    for i in range(196):
        class_names[0, i] = np.array([f"Car model {i + 1}"])
    scipy.io.savemat(str(root / "cars_annos.mat"), {"annotations": annotations, "class_names": class_names})
    return fx


def make_inshop(root: Path) -> Fixture:
    """In-Shop: train items 1-4; query/gallery items 5-8 in both, item 9 gallery only (a distractor)."""
    fx = Fixture(root, classes={"train": {}, "query": {}, "gallery": {}})
    rows = []
    key = 0
    plan = (
        [("train", i, 3) for i in range(1, 5)]
        + [(s, i, 2) for i in range(5, 9) for s in ("query", "gallery")]
        + [("gallery", 9, 2)]
    )
    for split, item, count in plan:
        item_id = f"id_{item:08d}"
        for k in range(count):
            key += 1
            rel = f"img/{'WOMEN' if item % 2 else 'MEN'}/Dresses/{item_id}/{key:02d}_{k + 1}_front.jpg"
            save(class_image(item + 20, key, (32, 48)), root / rel)
            rows.append(f"{rel} {item_id} {split}")
        fx.classes[split][item_id] = fx.classes[split].get(item_id, 0) + count
    text = f"{len(rows)}\nimage_name item_id evaluation_status\n" + "\n".join(rows) + "\n"
    (root / "list_eval_partition.txt").write_text(text)
    return fx


def make_folder(root: Path) -> Fixture:
    """Class folders mixing JPEG, grayscale PNG, RGBA PNG and BMP; one non-image file per split is skipped."""
    fx = Fixture(root)
    formats = [("jpg", "JPEG", "RGB"), ("png", "PNG", "L"), ("png", "PNG", "RGBA"), ("bmp", "BMP", "RGB")]
    for split, names in (("train", ("apple", "banana", "cherry")), ("test", ("durian", "elderberry"))):
        fx.classes[split] = {}
        for ci, name in enumerate(names):
            c = 40 + ci + (10 if split == "test" else 0)
            for k, (ext, fmt, mode) in enumerate(formats[: 3 + ci % 2]):
                save(class_image(c, k, mode=mode), root / split / name / f"img{k}.{ext}", fmt)
            fx.classes[split][name] = 3 + ci % 2
        (root / split / names[0] / "notes.txt").write_text("not an image\n")
        fx.broken.append(f"{split}/{names[0]}/notes.txt")
    return fx


def make_folder_tree(root: Path, plan: dict[str, dict[str, int]]) -> Fixture:
    """``root/<split>/<class>/img<k>.jpg`` for ``plan[split][class] = count``; class names may hold any characters."""
    fx = Fixture(root)
    for split, classes in plan.items():
        fx.classes[split] = {}
        for ci, (name, count) in enumerate(classes.items()):
            for k in range(count):
                save(class_image(60 + ci + 20 * (split != "train"), k), root / split / name / f"img{k}.jpg")
            fx.classes[split][name] = count
    return fx


def make_folder_shared_class(root: Path) -> Fixture:
    """A folder tree that reuses class ``banana`` under both ``train/`` and ``test/`` (the build must refuse it)."""
    return make_folder_tree(root, {"train": {"apple": 2, "banana": 2}, "test": {"banana": 2, "cherry": 2}})


def make_table(root: Path, fmt: str = "csv", *, inshop: bool = True) -> tuple[Path, Fixture]:
    """A table of images (``table.csv`` or ``table.parquet``) with columns path, label, split, is_query, is_gallery
    and two extras (``sku`` text, ``price`` numbers); the images live under ``root/images/<label>/`` and are
    listed by relative paths, except the first image of each split, listed by its absolute path.

    Train labels ``shoe``, ``bag``, ``hat`` (3 images each); test labels ``sock``, ``belt``, ``scarf``: with
    ``inshop`` the first image of each test label is a query and the others gallery items (``scarf``'s 2 images
    are both gallery: a distractor), else every test row is both (self-retrieval). The Parquet file stores the
    flags as booleans, the price as floats (empty on train rows), the label as text.
    """
    fx = Fixture(root, classes={"train": {}, "query": {}, "gallery": {}} if inshop else {"train": {}, "test": {}})
    rows = []
    plan = [("train", "shoe", 3), ("train", "bag", 3), ("train", "hat", 3)]
    plan += [("test", "sock", 3), ("test", "belt", 3), ("test", "scarf", 2)]
    first = {"train": True, "test": True}
    for ci, (split, label, count) in enumerate(plan):
        for k in range(count):
            rel = f"images/{label}/{k}.jpg"
            save(class_image(70 + 3 * ci, k, (36, 30)), root / rel)
            query = split == "test" and (not inshop or (k == 0 and label != "scarf"))
            gallery = split == "test" and (not inshop or not query)
            path = str((root / rel).resolve()) if first[split] else rel
            first[split] = False
            rows.append((path, label, split, query, gallery, f"sku-{label}-{k}", None if split == "train" else 9.5 + k))
            key = split if not inshop or split == "train" else ("query" if query else "gallery")
            fx.classes[key][label] = fx.classes[key].get(label, 0) + 1
    import pandas as pd

    frame = pd.DataFrame(rows, columns=["path", "label", "split", "is_query", "is_gallery", "sku", "price"])
    if fmt == "csv":
        table = root / "table.csv"
        frame.assign(
            is_query=frame.is_query.map({True: "1", False: "0"}), is_gallery=frame.is_gallery.astype(str)
        ).to_csv(table, index=False)
    else:
        table = root / "table.parquet"
        frame.to_parquet(table, index=False)
    return table, fx


MAKERS = {"sop": make_sop, "cub": make_cub, "cars": make_cars, "inshop": make_inshop, "folder": make_folder}


def bomb_png(width: int, height: int) -> bytes:
    """A PNG of a few hundred bytes whose header claims ``width`` × ``height`` RGB pixels (a decompression bomb;
    its pixel data is cut short, so even a decoder that tried would not get far)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 4096))
        + chunk(b"IEND", b"")
    )
