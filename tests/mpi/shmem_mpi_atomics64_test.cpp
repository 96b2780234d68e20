// The SHMEM MPI suite's atomics on 64-bit words (shmem_mpi_atomics.hpp).
#include "shmem_mpi_atomics.hpp"

namespace mori::shmem {
namespace {

using namespace mpi_test;  // NOLINT(google-build-using-namespace): the suite's own helpers

TEST(ShmemTest, AtomicsInt64) { RunAtomics<int64_t>(); }
TEST(ShmemTest, AtomicsUint64) { RunAtomics<uint64_t>(); }

}  // namespace
}  // namespace mori::shmem
