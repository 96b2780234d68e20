// Transport names, parsing and sets.
#include <gtest/gtest.h>

#include "mori/channels/transport.hpp"

namespace mori::core {
namespace {

TEST(Transport, NamesParseBackCaseInsensitively) {
  for (int i = 1; i < kNumTransports; ++i) {
    auto t = static_cast<Transport>(i);
    auto parsed = ParseTransport(TransportName(t));
    ASSERT_TRUE(parsed.has_value()) << TransportName(t);
    EXPECT_EQ(*parsed, t);
  }
  EXPECT_EQ(ParseTransport("ib3"), Transport::IB3);
  EXPECT_EQ(ParseTransport("TCP"), Transport::Tcp);
  EXPECT_FALSE(ParseTransport("IB8").has_value());
  EXPECT_FALSE(ParseTransport("Unknown").has_value());
  EXPECT_FALSE(ParseTransport("").has_value());
}

TEST(Transport, KindsAndIbIndices) {
  EXPECT_TRUE(IsIbTransport(Transport::IB0));
  EXPECT_TRUE(IsIbTransport(Transport::IB7));
  EXPECT_FALSE(IsIbTransport(Transport::Emulated));
  EXPECT_TRUE(IsRdmaTransport(Transport::Emulated));
  EXPECT_FALSE(IsRdmaTransport(Transport::Tcp));
  EXPECT_FALSE(IsRdmaTransport(Transport::CudaIpc));
  for (int i = 0; i < kNumIbTransports; ++i) EXPECT_EQ(IbIndex(IbTransport(i)), i);
}

TEST(TransportFlags, SetsCombineAndPrint) {
  TransportFlags f = Transport::CudaIpc | Transport::IB2;
  EXPECT_TRUE(f.Has(Transport::CudaIpc));
  EXPECT_TRUE(f.Has(Transport::IB2));
  EXPECT_FALSE(f.Has(Transport::IB0));
  EXPECT_FALSE(f.Has(Transport::Unknown));
  EXPECT_TRUE(f.HasRdma());
  EXPECT_FALSE(TransportFlags(Transport::Tcp).HasRdma());
  EXPECT_EQ(f.ToString(), "CudaIpc|IB2");
  EXPECT_EQ(TransportFlags().ToString(), "none");
  EXPECT_TRUE(TransportFlags().Empty());
  EXPECT_TRUE(TransportFlags(Transport::Unknown).Empty());
  f |= Transport::Tcp;
  EXPECT_EQ((f & TransportFlags(Transport::Tcp)), TransportFlags(Transport::Tcp));
  EXPECT_EQ(TransportFlags::FromBits(~0u).ToString(), "CudaIpc|IB0|IB1|IB2|IB3|IB4|IB5|IB6|IB7|Tcp|Emulated");
}

}  // namespace
}  // namespace mori::core
