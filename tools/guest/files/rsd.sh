#!/bin/sh
# A software developer at work, for block traces (tools/chunksim): a scaled-down imitation of the papers'
# Roaming Software Developer benchmark (RSD: untar, configure, build, grep, touch headers, rebuild), with a
# fixed think time between tasks as RSD had (10 s there).
#
#   rsd.sh [THINK]   THINK seconds between tasks (default 2); prints
#                    ISR-RSD ok files=N objects=M rebuilt=R matches=G seconds=S   (or ISR-RSD fail reason=W)
#
# Tasks: unpack the source archive; "configure" (walk the tree, stat everything, write a log); build (for
# every .py file a derived object with comments and blank lines stripped, then link them all into one file
# and compress it); grep the tree; touch every __init__.py ("headers") and rebuild what is older than its
# source (make's rule, with test -nt); checksum the tree; delete everything. Safe to run again.
set -u
here=$(dirname "$0")
. "$here/config"
THINK=${1:-2}
dev=/data/dev

fail() {
    echo "ISR-RSD fail reason=$1"
    exit 1
}

think() {
    sleep "$THINK"
}

# compile SRC: the object of one source file, in obj/ under the same relative path
compile() {
    obj="obj/${1#src/}.o"
    mkdir -p "$(dirname "$obj")" || return 1
    awk '!/^[ \t]*#/ && NF { print }' "$1" >"$obj"
}

# build all|changed: (re)compile every source, or those newer than their object; link; sets $built
build() {
    n=0
    for src in $(find src -type f -name '*.py' | sort); do
        obj="obj/${src#src/}.o"
        if [ "$1" = all ] || [ "$src" -nt "$obj" ]; then
            compile "$src" || fail "compile-$src"
            n=$((n + 1))
        fi
    done
    # link: every object into one image, then a compressed release of it
    find obj -type f -name '*.o' | sort | xargs cat >program || fail link
    gzip -c program >program.gz || fail package
    built=$n
}

read -r start idle </proc/uptime
rm -rf "$dev" || fail rm-old
mkdir -p "$dev" || fail mkdir
cd "$dev" || fail cd

mkdir src && tar -xzf "$ARCHIVE" -C src || fail unpack
files=$(find src -type f | wc -l)
think

find src -type d | wc -l >config.log && ls -lR src >>config.log || fail configure
think

build all
objects=$built
think

matches=$(grep -r -l -F 'import os' src | wc -l)
think

find src -type f -name '__init__.py' | xargs touch || fail touch
build changed
rebuilt=$built
think

(cd src && find . -type f | sort | xargs sha256sum) >sums || fail checksum
think

cd / && rm -rf "$dev" || fail delete
sync || fail sync

read -r end idle </proc/uptime
seconds=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f", b - a }')
echo "ISR-RSD ok files=$files objects=$objects rebuilt=$rebuilt matches=$matches seconds=$seconds"
