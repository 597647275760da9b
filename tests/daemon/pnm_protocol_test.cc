// The split attend's wire encoding (pnm/service_protocol.h): held lists and recalls as ascending
// page lists of shortest-form varints, stays as bits. Round trips, the one encoding each list
// has, refusals of what a stranger could send, and the sizes that make a million-token hybrid
// fit one RPC slot (4 bytes a page did not at a budget of 1/8).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "pnm/service_protocol.h"
#include "rpc/area.h"

namespace cxlkv::pnm {
namespace {

AttendJobRequest SplitJob(uint32_t heads, uint32_t head_dim, uint32_t budget) {
  AttendJobRequest j;
  j.context = 7;
  j.layer = 3;
  j.budget_tokens = budget;
  j.q.assign(size_t{heads} * head_dim, 0.5f);
  return j;
}

// `n` distinct pages below `limit`, ascending.
std::vector<uint32_t> RandomPages(std::mt19937& rng, uint32_t n, uint32_t limit) {
  std::vector<uint32_t> all(limit);
  for (uint32_t i = 0; i < limit; ++i) all[i] = i;
  std::shuffle(all.begin(), all.end(), rng);
  std::vector<uint32_t> out(all.begin(), all.begin() + n);
  std::sort(out.begin(), out.end());
  return out;
}

TEST(PnmProtocol, HeldListsRoundTripInTheirOneEncodingAndMalformedOnesAreRefused) {
  AttendJobRequest j = SplitJob(4, 16, 512);
  j.hold_capacity = 9;
  // Encoded values (the first page, then each gap minus 1) on both sides of every varint
  // length's edge — 1, 2, 3, 4 and 5 bytes — ending at the largest page; an empty list.
  const std::vector<uint32_t> values = {0,       127,           128,           16383,
                                        16384,   (1u << 21) - 1, 1u << 21,      (1u << 28) - 1,
                                        1u << 28};
  std::vector<uint32_t> edges;
  uint64_t page = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    page = i == 0 ? values[0] : page + 1 + values[i];
    edges.push_back(static_cast<uint32_t>(page));
  }
  edges.push_back(0xffffffffu);  // a gap past 2^28: five bytes
  j.held = {edges, {}, {127}};
  std::vector<uint8_t> bytes;
  EncodeAttendSplit({&j, 1}, bytes);
  // The capacity, the list count, three counts, then 1+1+2+2+3+3+4+4+5+5 bytes and 1 byte.
  EXPECT_EQ(HeldListsBytes(j.held), 8 + 3 * 4 + 30 + 1);
  EXPECT_EQ(bytes.size(), 4 + AttendJobRequestBytes(j.q.size()) + HeldListsBytes(j.held));
  auto back = DecodeAttendSplit(bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->size(), 1u);
  EXPECT_EQ((*back)[0].held, j.held);
  EXPECT_EQ((*back)[0].hold_capacity, 9u);
  EXPECT_EQ((*back)[0].q, j.q);

  // The single list {5}: u32 count 1, then the varint 5. A longer form of 5 (0x85 0x00), a
  // varint past 32 bits, a page past 2^32 − 1, or a count past the bytes are refused.
  AttendJobRequest one = SplitJob(4, 16, 512);
  one.held = {{5}};
  std::vector<uint8_t> good;
  EncodeAttendSplit({&one, 1}, good);
  ASSERT_TRUE(DecodeAttendSplit(good).ok());
  ASSERT_EQ(good.back(), 5);
  const std::vector<uint8_t> head(good.begin(), good.end() - 1);  // all but the varint
  auto with = [&](std::vector<uint8_t> varint) {
    std::vector<uint8_t> v = head;
    v.insert(v.end(), varint.begin(), varint.end());
    return v;
  };
  ASSERT_TRUE(DecodeAttendSplit(with({5})).ok());
  EXPECT_EQ(DecodeAttendSplit(with({0x85, 0x00})).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeAttendSplit(with({0xff, 0xff, 0xff, 0xff, 0x1f})).status().code(),  // 33 bits
            StatusCode::kInvalidArgument);
  AttendJobRequest past = SplitJob(4, 16, 512);
  past.held = {{0xffffffffu}};
  std::vector<uint8_t> over;
  EncodeAttendSplit({&past, 1}, over);
  over[over.size() - 9] = 2;  // the list's count: now two pages, the second one past 2^32 − 1
  over.push_back(0);
  EXPECT_EQ(DecodeAttendSplit(over).status().code(), StatusCode::kInvalidArgument);
  std::vector<uint8_t> cut(good.begin(), good.end() - 1);
  EXPECT_EQ(DecodeAttendSplit(cut).status().code(), StatusCode::kInvalidArgument);

  EXPECT_TRUE(UnorderedHeldList(j.held).empty());
  const std::vector<std::vector<uint32_t>> repeated = {{1, 2}, {3, 3}};
  EXPECT_NE(UnorderedHeldList(repeated).find("KV head 1"), std::string::npos);
}

TEST(PnmProtocol, AnAnswersStaysAndRecallsRoundTripAndTheirSpareBitsMustBeZero) {
  const std::vector<uint32_t> ranked = {40, 3, 17, 99, 5, 60, 8};  // best first
  const std::vector<uint32_t> held = {3, 8, 50, 60, 70};
  const SplitHeadAnswer a = SplitHeadOf(ranked, held, 6);
  EXPECT_EQ(a.selected, 7u);
  EXPECT_EQ(a.stays, (std::vector<uint8_t>{1, 1, 0, 1, 0}));
  EXPECT_EQ(a.recall, (std::vector<uint32_t>{17, 40, 99}));  // room 6 − 3: the three best not held
  EXPECT_TRUE(SplitHeadOf(ranked, held, 2).recall.empty()) << "no room past what stayed";

  Partial p;
  p.num_heads = 2;
  p.head_dim = 16;
  p.out.assign(32, 1.0f);
  p.lse.assign(2, 0.0f);
  std::vector<uint8_t> out(4096);
  meta::WireWriter w(out);
  const std::vector<SplitHeadAnswer> heads = {a, SplitHeadOf({}, {}, 4)};
  PutSplitJobOk(w, 12, p, heads);
  out.resize(w.size());
  const std::vector<std::pair<uint32_t, uint32_t>> shapes = {{2, 16}};
  const std::vector<uint32_t> kv_heads = {2};
  auto back = DecodeAttendSplitAnswer(out, shapes, kv_heads);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ((*back)[0].heads.size(), 2u);
  EXPECT_EQ((*back)[0].heads[0].stays, a.stays);
  EXPECT_EQ((*back)[0].heads[0].recall, a.recall);
  EXPECT_EQ((*back)[0].heads[0].selected, 7u);
  EXPECT_TRUE((*back)[0].heads[1].stays.empty());
  // The stays byte of head 0 holds 5 bits: a sixth set is refused, as is an answer cut short.
  const size_t stays_at = AttendJobAnswerBytes(2, 16) + 4 + 4;
  ASSERT_EQ(out[stays_at], 0b01011);
  std::vector<uint8_t> spare = out;
  spare[stays_at] |= 0x20;
  EXPECT_EQ(DecodeAttendSplitAnswer(spare, shapes, kv_heads).status().code(), StatusCode::kCorrupted);
  std::vector<uint8_t> cut(out.begin(), out.end() - 1);
  EXPECT_EQ(DecodeAttendSplitAnswer(cut, shapes, kv_heads).status().code(), StatusCode::kCorrupted);
}

// What made the remote hybrid refuse a 1M-token context at a budget of 1/8 (4 bytes a page:
// 66 KiB of ranks for a 32 KiB slot): tiny-llama's geometry (8 heads, 2 KV heads, head_dim 32),
// 65536 pages, half the budget's 8192 pages held per KV head. With a page a byte it fits, and so
// does an 8B-class model (32 heads, 8 KV heads, head_dim 128) at 128K and 1/8.
TEST(PnmProtocol, AMillionTokenHybridAtAnEighthFitsOneSlot) {
  const rpc::RpcGeometry g = PnmGeometry();
  const uint64_t request_room = g.request_bytes - rpc::kSlotHeaderBytes;
  const uint64_t answer_room = g.response_bytes - rpc::kSlotHeaderBytes;
  struct Case {
    uint32_t heads, kv_heads, head_dim;
    uint64_t pages;
  };
  std::mt19937 rng(3);
  for (const Case c : {Case{8, 2, 32, 65536}, Case{32, 8, 128, 8192}}) {
    const uint32_t budget_pages = static_cast<uint32_t>(c.pages / 8);
    AttendJobRequest j = SplitJob(c.heads, c.head_dim, budget_pages * 16);
    j.hold_capacity = budget_pages / 2;
    for (uint32_t h = 0; h < c.kv_heads; ++h) {
      j.held.push_back(RandomPages(rng, j.hold_capacity, static_cast<uint32_t>(c.pages)));
    }
    const uint64_t request = 4 + AttendJobRequestBytes(j.q.size()) + HeldListsBytes(j.held);
    const uint64_t answer =
        AttendJobAnswerBytes(c.heads, c.head_dim) + SplitAnswerBytesBound(j, c.kv_heads, c.pages, 16);
    EXPECT_LE(request, request_room) << c.heads << " heads, " << c.pages << " pages";
    EXPECT_LE(answer, answer_room) << c.heads << " heads, " << c.pages << " pages";
    // The encoder stays within the bound on the widest answer it can write: a bit per held page
    // and `capacity` recalls, as many of them two bytes long (gaps of 129) as the context has
    // room for, and one last recall at the context's last page.
    std::vector<SplitHeadAnswer> heads(c.kv_heads);
    for (auto& h : heads) {
      h.selected = budget_pages;
      h.stays.assign(j.hold_capacity, 1);
      uint64_t next = 0;
      for (uint32_t k = 0; k + 1 < j.hold_capacity; ++k) {
        const uint64_t left = j.hold_capacity - 1 - k;  // recalls still to place after this one
        h.recall.push_back(static_cast<uint32_t>(next));
        next += next + 129 + left < c.pages ? 129 : 1;
      }
      h.recall.push_back(static_cast<uint32_t>(c.pages - 1));
    }
    Partial p;
    p.num_heads = c.heads;
    p.head_dim = c.head_dim;
    p.out.assign(size_t{c.heads} * c.head_dim, 0.0f);
    p.lse.assign(c.heads, 0.0f);
    std::vector<uint8_t> out(answer + (64 << 10));
    meta::WireWriter w(out);
    PutSplitJobOk(w, 0, p, heads);
    ASSERT_FALSE(w.overflow());
    EXPECT_LE(w.size(), answer) << "an answer larger than its bound";
    EXPECT_GT(w.size(), AttendJobAnswerBytes(c.heads, c.head_dim) + c.kv_heads * (12 + j.hold_capacity / 8 +
                                                                                   j.hold_capacity))
        << "the answer is not the widest one";
  }
}

}  // namespace
}  // namespace cxlkv::pnm
