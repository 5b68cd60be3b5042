#!/usr/bin/env bash
# Builds the container images (Containerfile) with buildah and tests them: inside each image's
# own root (chroot), as its non-root user, `processor --version`, `check-config` on every example
# config, and the demo's job (examples/batch/demo.jsonl) through the dispatcher simulator of the
# second image, so that a missing library, file or certificate fails here.
#
#   bash scripts/image.sh            build and test: batch-processor:VERSION, async-dispatcher-sim:VERSION
#   IMAGE_SKIP_TEST=1 bash scripts/image.sh   build only
#
# Not part of CI: it needs a static release build of its own (about 10 minutes on 2 idle cores
# from a clean clone, 27 measured on a busy machine) on top of CI's debug builds. Run it with
# `just image` before a release.
# buildah runs with the vfs storage driver and chroot isolation, which work without a container
# runtime, overlay mounts or user namespaces. No registry is needed: the images are FROM scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

if [ "$(id -u)" != 0 ]; then
  # buildah mount and chroot need root, or buildah's own user namespace.
  command -v buildah >/dev/null || { echo "buildah is missing: install it as root (apt-get install buildah)" >&2; exit 1; }
  exec buildah unshare bash "$0" "$@"
fi
ensure_buildah
ensure_redis
export STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot

target=x86_64-unknown-linux-gnu
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
source_url=$(git remote get-url origin 2>/dev/null || echo unknown)
processor_image=batch-processor:$version
sim_image=async-dispatcher-sim:$version

echo "== building the static release binaries (cargo --release --target $target, +crt-static)"
echo "   (a first build takes 10 minutes or more on 2 cores; cargo shows its progress)"
# RUSTFLAGS with an explicit --target applies to the binaries only, not to build scripts and
# proc macros, which must stay dynamic to run on the build machine.
RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release --target "$target" --bin processor --bin async-dispatcher-sim
bin=target/$target/release
for b in processor async-dispatcher-sim; do
  # A static(-pie) binary needs no shared library: no NEEDED entry.
  if readelf -d "$bin/$b" | grep -q NEEDED; then echo "$bin/$b is not static" >&2; exit 1; fi
done

echo "== staging the build context (target/image/context)"
ctx=target/image/context
rm -rf "$ctx"
mkdir -p "$ctx/etc/ssl/certs" "$ctx/var/lib/batch-processor"
cp "$bin/processor" "$bin/async-dispatcher-sim" "$ctx/"
strip "$ctx/processor" "$ctx/async-dispatcher-sim"
ca=/etc/ssl/certs/ca-certificates.crt
[ -s "$ca" ] || { echo "no CA bundle at $ca (apt-get install ca-certificates)" >&2; exit 1; }
cp "$ca" "$ctx/etc/ssl/certs/ca-certificates.crt"
printf 'root:x:0:0:root:/:/sbin/nologin\nbatch:x:65532:65532:batch processor:/var/lib/batch-processor:/sbin/nologin\n' \
  > "$ctx/etc/passwd"
printf 'root:x:0:\nbatch:x:65532:\n' > "$ctx/etc/group"

for stage in dispatcher-sim processor; do
  image=$processor_image
  [ "$stage" = dispatcher-sim ] && image=$sim_image
  echo "== buildah bud --target $stage -t $image"
  buildah bud --quiet --layers=false --target "$stage" -t "$image" \
    --build-arg "VERSION=$version" --build-arg "REVISION=$revision" \
    --build-arg "SOURCE=$source_url" -f Containerfile "$ctx" >/dev/null
  echo "   $image: $(buildah images --format '{{.Size}}' "$image" | head -n 1)"
done

if [ "${IMAGE_SKIP_TEST:-}" = 1 ]; then exit 0; fi
bash scripts/image-test.sh "$processor_image" "$sim_image"
