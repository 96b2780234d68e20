#!/usr/bin/env bash
# The Debian package as a user gets it: builds it from the already-built tree (cmake --build --target
# package), checks its Depends line and contents, extracts it into a scratch root (dpkg -x: the system is
# not touched), and runs mori-info and a two-PE SHMEM example from there with a clean environment.
#
#   run_package_test.sh BUILD_DIR WORK_DIR VERSION [MPIRUN]   (no MPIRUN: the SHMEM example is not run)
# MORI_PACKAGE_DEB=FILE tests a package built before (the CUDA package, built on the development machine and
# carried to the GPU machine) instead of building one.
set -euo pipefail
build=$1 work=$2 version=$3 mpirun=${4:-}
fail() { echo "package test: $*" >&2; exit 1; }

rm -rf "$work"
mkdir -p "$work/root"
if [ -n "${MORI_PACKAGE_DEB:-}" ]; then
  deb=$MORI_PACKAGE_DEB
else
  deb="$build/mori_${version}_$(dpkg --print-architecture).deb"
  rm -f "$deb"
  cmake --build "$build" --target package > "$work/package.log" 2>&1 || { tail -n 40 "$work/package.log"; fail "building the package failed"; }
fi
[ -f "$deb" ] || fail "no $deb"
echo "package: $(basename "$deb"), $(stat -c %s "$deb") bytes"

depends=$(dpkg-deb -f "$deb" Depends)
echo "Depends: $depends"
echo "Recommends: $(dpkg-deb -f "$deb" Recommends)"
for dep in libc6 libstdc++6; do
  [[ "$depends" == *"$dep"* ]] || fail "Depends lacks $dep"
done
# rdma-core is opened at run time and must never be a hard dependency.
[[ "$depends" != *ibverbs* && "$depends" != *mlx5* ]] || fail "Depends names rdma-core: $depends"

contents=$(dpkg-deb -c "$deb")
for path in ./usr/bin/mori-info /libmori_shmem.so /libmori_channels.so /libmori_rdma.so /libmori_core.so \
            ./usr/include/mori/channels/port_channel.hpp ./usr/include/mori/core/port_channel.hpp \
            ./usr/include/mori/core/config.hpp /cmake/mori/moriConfig.cmake; do
  grep -qF -- "$path" <<< "$contents" || fail "the package lacks $path"
done

dpkg -x "$deb" "$work/root"
clean=(env -i PATH=/usr/bin:/bin HOME="$work")
# Open MPI's own settings stay (a machine without ssh names its launcher agent in OMPI_MCA_plm_rsh_agent);
# nothing that finds libraries does.
for v in $(compgen -e); do
  [[ "$v" == OMPI_MCA_* || "$v" == OMPI_ALLOW_RUN_AS_ROOT* ]] && clean+=("$v=${!v}")
done
out=$("${clean[@]}" timeout 60 "$work/root/usr/bin/mori-info") || fail "mori-info from the package failed ($?)"
grep -qE "^mori ${version//./\\.}, backend" <<< "$out" || fail "mori-info printed no version line: $out"
echo "mori-info: $(head -n 1 <<< "$out")"

if [ -n "$mpirun" ]; then
  example=$(find "$work/root" -path '*/mori/examples/shmem_put' -type f)
  [ -n "$example" ] || fail "the package lacks the shmem_put example"
  out=$("${clean[@]}" timeout 120 "$mpirun" --allow-run-as-root --oversubscribe -np 2 -x MORI_SHMEM_HEAP_SIZE=64m \
        -x MORI_TIMEOUT_S=60 "$example" 2>&1) || fail "shmem_put from the package failed ($?): $out"
  grep -q "^shmem_put: 2 PEs, .*: Success" <<< "$out" || fail "shmem_put printed no success line: $out"
  echo "$(grep '^shmem_put:' <<< "$out")"
fi
echo "package test: ok"
