#!/usr/bin/env bash
# Builds the SMPI simulation driver: bench/simulation/driver.cc and the engine's
# core sources (the ddlfast_core list of CMakeLists.txt, host side only) with
# smpicxx, into $1 (default build/simulation/ddlfast_sim_driver). Incremental:
# skipped when the output is newer than every source. ddlfast/simulate.py runs it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:-$root/build/simulation/ddlfast_sim_driver}"
command -v smpicxx >/dev/null || { echo "smpicxx not found: install SimGrid (apt-get install libsimgrid-dev)" >&2; exit 2; }

# ddlfast_core's own list in CMakeLists.txt, the one source of truth (no CUDA: SMPI ranks are single-threaded
# host code), plus the scalar kernels, the no-CUDA stub and the driver.
mapfile -t core < <(sed -n '/^add_library(ddlfast_core STATIC/,/DDLFAST_KERNEL_SOURCES/p' "$root/CMakeLists.txt" |
                    grep -o 'src/[A-Za-z0-9_/]*\.cc')
[[ ${#core[@]} -gt 0 ]] || { echo "no ddlfast_core sources found in $root/CMakeLists.txt" >&2; exit 2; }
sources=("${core[@]}" src/kernels/cpu/cpu_scalar.cc src/common/cuda_info_none.cc bench/simulation/driver.cc)
if echo 'int main(){}' | c++ -mavx2 -mf16c -x c++ - -o /dev/null 2>/dev/null; then
  avx2=src/kernels/cpu/cpu_avx2.cc
else
  avx2=src/kernels/cpu/cpu_no_avx2.cc
fi

newest_source=$(cd "$root" && ls -t "${sources[@]}" "$avx2" src/*/*.h src/*/*/*.h bench/simulation/build.sh bench/simulation/smpi_compat.h | head -1)
if [[ -f "$out" && "$out" -nt "$root/$newest_source" ]]; then exit 0; fi

objects="$(dirname "$out")/objects"
mkdir -p "$objects"
flags=(-std=c++17 -O2 -fno-gnu-unique -Wall -Wextra -ffp-contract=off -I"$root/src" -include "$root/bench/simulation/smpi_compat.h" -DOMPI_SKIP_MPICXX=1 -DMPICH_SKIP_MPICXX=1)
pids=()
compile() {  # source, extra flags...
  local source=$1; shift
  smpicxx "${flags[@]}" "$@" -c "$root/$source" -o "$objects/$(basename "$source" .cc).o" &
  pids+=($!)
}
for source in "${sources[@]}"; do compile "$source"; done
if [[ $avx2 == *avx2.cc ]]; then compile "$avx2" -mavx2 -mf16c; else compile "$avx2"; fi
for pid in "${pids[@]}"; do wait "$pid"; done
# This build's objects only: one left behind by a source that was renamed or removed would link in too.
linked=()
for source in "${sources[@]}" "$avx2"; do linked+=("$objects/$(basename "$source" .cc).o"); done
smpicxx "${flags[@]}" "${linked[@]}" -o "$out.tmp"
mv "$out.tmp" "$out"
