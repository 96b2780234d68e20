// The SHMEM MPI suite's atomics on 32-bit words (shmem_mpi_atomics.hpp).
#include "shmem_mpi_atomics.hpp"

namespace mori::shmem {
namespace {

using namespace mpi_test;  // NOLINT(google-build-using-namespace): the suite's own helpers

TEST(ShmemTest, AtomicsInt32) { RunAtomics<int32_t>(); }
TEST(ShmemTest, AtomicsUint32) { RunAtomics<uint32_t>(); }

}  // namespace
}  // namespace mori::shmem
